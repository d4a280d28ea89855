"""The house's layers, read from the imports of the package: every import points down the layer list and no
files import each other in a loop.

Layers, bottom up (a file's layer is that of its first folder under ``pagedllm/``, or of the file itself):
plain data and settings; device facts; the torch-free scheduling core and the kernels; attention, model code,
sampling and the other feature rooms; the worker; the executors; the engine; the entry points; the benchmarks.
An import inside a function counts (it is a dependency all the same); one under ``if TYPE_CHECKING:`` does not.
A package ``__init__.py`` that only hands names on, and the public face ``pagedllm/__init__.py``, are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("envs", "config", "sampling_params", "pooling_params", "outputs", "utils", "logger"),
    ("platforms", "host_to_device"),
    ("core", "kernels"),
    ("attention", "model_executor", "sample", "structured_output", "spec_decode", "distributed", "audio", "lora",
     "multimodal"),
    ("worker",),
    ("executor",),
    ("engine", "engine_args", "metrics"),
    ("entrypoints", "__main__"),
    ("benchmarks",),
)
LAYER_OF = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def module_files(package: Path) -> dict[str, Path]:
    """{dotted module name: file} for every .py under ``package`` (a package is named by its folder)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def only_hands_names_on(path: Path) -> bool:
    """A short ``__init__.py`` with no function or class: a facade the plan allows."""
    tree = ast.parse(path.read_text())
    return not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in ast.walk(tree))


def _under_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def imported_names(path: Path, module: str, is_package: bool) -> list[tuple[int, str]]:
    """[(line, dotted name)] of every import in ``path`` (relative ones resolved; ``from a import b`` gives
    ``a.b``, which the caller narrows to ``a`` when ``a.b`` is no module); TYPE_CHECKING blocks skipped."""
    out: list[tuple[int, str]] = []
    here = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _under_type_checking(child):
                for other in child.orelse:
                    visit(other)
            elif isinstance(child, ast.Import):
                out.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = here[:len(here) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                out.extend((child.lineno, f"{base}.{alias.name}") for alias in child.names)
            else:
                visit(child)

    visit(ast.parse(path.read_text()))
    return out


def import_edges(package: Path) -> dict[str, set[tuple[int, str]]]:
    """{module: {(line, imported module)}} inside the package, facades left out."""
    files = module_files(package)
    root = package.name
    facades = {name for name, path in files.items()
               if name == root or (path.name == "__init__.py" and len(path.read_text().splitlines()) < 40
                                   and only_hands_names_on(path))}
    edges: dict[str, set[tuple[int, str]]] = {name: set() for name in files}
    for name, path in files.items():
        for line, target in imported_names(path, name, path.name == "__init__.py"):
            if not target.startswith(root + "."):
                continue
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in files and target != name and target not in facades:
                edges[name].add((line, target))
    return edges


def layer(module: str) -> int:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else "__init__"
    return LAYER_OF.get(room, LAYER_OF["attention"])


def upward_imports(package: Path) -> list[str]:
    """'module:line -> target' for every import from a lower layer to a higher one."""
    return sorted(f"{name}:{line} -> {target}" for name, targets in import_edges(package).items()
                  for line, target in targets if name != package.name and layer(target) > layer(name))


def import_cycles(package: Path) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    graph = {name: {t for _, t in targets} for name, targets in import_edges(package).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(groups)


def test_the_drawing_reads_the_package() -> None:
    edges = import_edges(PACKAGE)
    assert len(edges) > 150 and sum(map(len, edges.values())) > 500


def test_every_room_has_a_layer() -> None:
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    assert rooms - {"__init__"} <= set(LAYER_OF)


def test_no_import_runs_upward() -> None:
    assert upward_imports(PACKAGE) == []


def test_no_files_import_each_other_in_a_loop() -> None:
    assert import_cycles(PACKAGE) == []


@pytest.fixture
def tangled(tmp_path: Path) -> Path:
    """A package with one upward import (platforms -> worker, inside a function) and one loop (core)."""
    pkg = tmp_path / "pagedllm"
    for folder in ("platforms", "worker", "core"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "platforms" / "cpu.py").write_text("def f():\n    from pagedllm.worker import memory\n")
    (pkg / "worker" / "memory.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from pagedllm.executor import x\n")
    (pkg / "core" / "a.py").write_text("from . import b\n")
    (pkg / "core" / "b.py").write_text("from pagedllm.core.a import thing\n")
    return pkg


def test_the_checks_see_what_they_forbid(tangled: Path) -> None:  # the two checks above must be able to fail
    assert upward_imports(tangled) == ["pagedllm.platforms.cpu:2 -> pagedllm.worker.memory"]
    assert import_cycles(tangled) == [["pagedllm.core.a", "pagedllm.core.b"]]
