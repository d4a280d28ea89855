"""Device-specific choices are made by the platform (pagedllm/platforms/), never by the layers, the sampler,
the runner or the worker: a count of device tests and ``torch.cuda`` calls outside the platform, the attention
backends and the kernels is zero."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

import pagedllm.kernels  # noqa: F401 - registers the kernel families the platforms name
from pagedllm.platforms import CpuPlatform, CudaPlatform, Platform, platform_for, platform_of

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"
# Where choosing by device is the job: the platforms, the attention backends, the kernels themselves; and the
# CUDA graph runner, which is CUDA's own (captures and replays torch.cuda graphs; the platform says whether
# graphs are supported and the worker picks the runner).
DECIDERS = ("platforms/", "attention/backends/", "kernels/", "worker/cuda_graphs.py")
DEVICE_TEST = re.compile(r"\.is_cuda\b|\.is_cpu\b|device\.type\b|\.device\.type\b|\btorch\.cuda\b")


def device_tests(root: Path) -> dict[str, int]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(DECIDERS):
            continue
        hits = len(DEVICE_TEST.findall(path.read_text()))
        if hits:
            found[rel] = hits
    return found


def test_no_device_tests_outside_the_platform() -> None:
    assert device_tests(PACKAGE) == {}


def test_the_count_sees_a_device_test(tmp_path: Path) -> None:  # the count above must be able to fail
    (tmp_path / "layer.py").write_text("def f(x):\n    return x.is_cuda or x.device.type == 'cpu'\n")
    (tmp_path / "worker.py").write_text("import torch\n\ndef free():\n    return torch.cuda.mem_get_info()[0]\n")
    assert device_tests(tmp_path) == {"layer.py": 2, "worker.py": 1}


def test_each_device_has_one_platform() -> None:
    assert isinstance(platform_for("cpu"), CpuPlatform)
    assert isinstance(platform_for(torch.device("cuda", 1)), CudaPlatform)
    assert platform_for("cuda:0") is platform_for("cuda")
    assert platform_of(torch.zeros(1)) is platform_for("cpu")
    meta = platform_for("meta")  # any other device: plain torch
    assert type(meta) is Platform and meta.cpu_kernels(torch.float32) is None


def test_the_cpu_platform_serves_float32_kernels_only() -> None:
    cpu = platform_for("cpu")
    assert cpu.cpu_kernels(torch.float32) is not None, "the C++ CPU kernels must build on the test machine"
    assert cpu.cpu_kernels(torch.bfloat16) is None
    assert cpu.cpu_kernels(torch.bfloat16, (torch.float32, torch.bfloat16)) is not None
    assert cpu.elementwise_kernels(torch.float32) is cpu.cpu_kernels(torch.float32)
    assert cpu.rotary_kernels(torch.float32, torch.bfloat16) is None
    assert not cpu.is_accelerator and not cpu.supports_graphs and not cpu.packs_quantized_by_rows
    cuda = platform_for("cuda")
    assert cuda.is_accelerator and cuda.supports_graphs and cuda.packs_quantized_by_rows
    assert cuda.cpu_kernels(torch.float32) is None


# The platforms stand on these only (the house plan's layer 0), and name what stands above them.
GROUND_FLOOR = {"envs", "config", "sampling_params", "pooling_params", "outputs", "utils", "logger", "platforms"}


def pagedllm_imports(path: Path) -> set[str]:
    """The pagedllm modules ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "pagedllm" and node.level == 0:
            found.update(f"pagedllm.{alias.name}" for alias in node.names)  # from pagedllm import envs
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("pagedllm.")}


def test_the_platforms_import_nothing_above_them() -> None:
    upward = {f"{path.name} -> {name}" for path in sorted((PACKAGE / "platforms").glob("*.py"))
              for name in pagedllm_imports(path) if name.split(".")[1] not in GROUND_FLOOR}
    assert upward == set()
    assert pagedllm_imports(PACKAGE / "platforms" / "interface.py") >= {"pagedllm.config"}  # the check reads imports
