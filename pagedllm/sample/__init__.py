"""Logits to token ids. The draws ask their logits' platform for the C++ kernels (``draw.py``); importing the
kernels package registers the kernel families those answers name."""

import pagedllm.kernels  # noqa: F401
