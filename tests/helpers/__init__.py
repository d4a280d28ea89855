"""Helpers the tests share across folders: fakes (scheduler runner, KV connector, faulty engine and ranks),
tiny-model builders and writers (HF folders, GGUF files, Whisper), prompts, schemas and servers.

``tests/`` is on ``sys.path`` through pytest's ``pythonpath`` (pyproject.toml), so a test in any folder imports
``from helpers.model_helpers import make_tiny_llama``; a process it spawns inherits the path. Outside pytest, put
``tests`` on ``PYTHONPATH``."""
