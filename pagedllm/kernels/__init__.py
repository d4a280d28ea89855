"""Native kernels: C++ for the CPU (built on first use), Triton for CUDA, with torch fallbacks where they cannot
be built. Importing the package registers the kernel families with the platforms (``registry.py``)."""

from pagedllm.kernels import registry  # noqa: F401 - registers the families' loaders
