"""Pieces that span processes: KV cache event publishing and subscribing (``kv_events.py``)."""
