"""KV transfer between instances (disaggregated prefill and decode): vLLM's ``KVConnectorBase_V1`` seam.

``config.py`` parses ``--kv-transfer-config``; ``base.py`` is the connector interface (a scheduler half and a
worker half); ``factory.py`` builds a connector by name; ``shared_storage.py``, ``nixl.py`` and ``multi.py`` are
the connectors; ``scheduler_hooks.py`` is what the scheduler calls. See docs/disaggregation.md.
"""
