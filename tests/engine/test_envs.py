"""One module reads the environment (pagedllm/envs.py), and docs/environment.md lists what it reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedllm import envs

PACKAGE = Path(envs.__file__).parent
DOC = PACKAGE.parent / "docs" / "environment.md"


def _environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read ``os.environ`` / ``os.getenv`` (setting a variable for a child is no read)."""
    tree = ast.parse(path.read_text())
    stores = {id(node.value) for node in ast.walk(tree)
              if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
            and node.attr in ("environ", "getenv") and id(node) not in stores]


def test_no_module_but_envs_reads_the_environment() -> None:
    reads = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "envs.py" and (lines := _environment_reads(p))}
    assert reads == {}


def test_the_reader_finds_a_read() -> None:  # the scan above would pass vacuously if it found nothing
    assert _environment_reads(PACKAGE / "envs.py")


def test_the_doc_table_lists_every_variable_with_its_default() -> None:
    rows = {line.split("|")[1].strip(" `"): line for line in DOC.read_text().splitlines()
            if line.startswith("| `")}
    assert set(rows) == set(envs.VARIABLES)
    for name, var in envs.VARIABLES.items():
        shown = "unset" if var.default is None else str(int(var.default) if isinstance(var.default, bool)
                                                            else var.default)
        assert f"`{shown}`" in rows[name].split("|")[2], (name, rows[name])


def test_values_parse_and_bad_ones_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_ISA", raising=False)
    assert envs.PAGEDLLM_CPU_ISA == "auto"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "AVX2")
    assert envs.PAGEDLLM_CPU_ISA == "avx2"
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "off")
    assert envs.PAGEDLLM_ENABLE_MULTIPROCESSING is False
    monkeypatch.setenv("PAGEDLLM_TRITON_ARCH", "80")
    assert envs.PAGEDLLM_TRITON_ARCH == 80
    for name, bad in [("PAGEDLLM_CPU_ISA", "sse"), ("PAGEDLLM_CPU_KERNELS", "maybe"), ("PAGEDLLM_TRITON_ARCH", "h100")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            getattr(envs, name)
    with pytest.raises(AttributeError):
        envs.PAGEDLLM_NO_SUCH_VARIABLE  # noqa: B018
