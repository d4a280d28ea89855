"""Images in prompts: fetching and decoding them (``media.py``), their content hashes (``hashing.py``), OpenAI chat
content parts (``chat.py``) and the model's own HF processor, which preprocesses pixels and expands placeholder
tokens (``processing.py``). See docs/vision.md."""
