"""Native kernels: C++ for the CPU (built on first use), with torch fallbacks where they cannot be built."""
