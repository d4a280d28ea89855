"""Device-specific choices are made by the platform (pagedllm/platforms/), never by the layers, the sampler,
the runner or the worker: a count of device tests outside the platform, the attention backends and the kernels
is zero."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pagedllm.platforms import CpuPlatform, CudaPlatform, Platform, platform_for, platform_of

PACKAGE = Path(__file__).resolve().parents[2] / "pagedllm"
# Where choosing by device is the job: the platforms, the attention backends, the kernels themselves.
DECIDERS = ("platforms/", "attention/backends/", "kernels/")
DEVICE_TEST = re.compile(r"\.is_cuda\b|\.is_cpu\b|device\.type\b|\.device\.type\b")


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
    assert device_tests(tmp_path) == {"layer.py": 2}


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
