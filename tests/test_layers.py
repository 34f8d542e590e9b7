"""The layers of the tree: what may import what (read from the source, not by importing).

- sim's core types (request, batch, kv, state, logs; strict for ConfigError,
  heap for the C heap)
  import nothing else of the project;
- policies import only policies and the core types;
- reports.experiments never imports reports.presentation;
- no module of the project takes part in an import cycle, counting imports
  inside functions too (only ``if TYPE_CHECKING:`` blocks are left out).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sim", "policies", "calibrate", "workloads", "reports")
CORE = {"sim.request", "sim.batch", "sim.kv", "sim.state", "sim.logs", "sim.strict", "sim.heap"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules ``path`` imports at run time (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) - {_module_name(p)} for p in files}


def test_core_types_import_nothing_above_them() -> None:
    graph = _graph()
    for module in CORE:
        assert graph[module] <= CORE, (module, graph[module] - CORE)


def test_policies_import_only_policies_and_core_types() -> None:
    for module, deps in _graph().items():
        if module.startswith("policies"):
            assert all(d.startswith("policies") or d in CORE for d in deps), (module, deps)


def test_experiments_never_import_presentation() -> None:
    for module, deps in _graph().items():
        if module.startswith("reports.experiments"):
            assert not [d for d in deps if d.startswith("reports.presentation")], module


def test_no_import_cycles() -> None:
    graph = _graph()

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return seen

    cyclic = sorted(m for m in graph if m in reaches(m))
    assert cyclic == []
