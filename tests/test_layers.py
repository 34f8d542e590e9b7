"""The floors of the tree: what may import what, read from the source (not by
importing it), counting imports inside functions and ``if TYPE_CHECKING:``
blocks alike: a type-only import is an arrow too.

- sim/ is built in floors (``sim/__init__``): base, core, cost, then results
  and loop beside each other, then run, then cli; a floor imports only the
  floors below it (``FLOORS``);
- policies import only policies, sim.base and sim.core;
- workloads import only workloads and sim.base;
- only sim.run (and sim.cli) imports policies and workloads; only sim.cli
  imports reports and calibrate;
- reports.experiments never imports reports.presentation;
- no module of the project takes part in an import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sim", "policies", "calibrate", "workloads", "reports")

# Each floor of sim/ and the packages it may import (besides itself).
FLOORS: dict[str, set[str]] = {
    "sim.base": set(),
    "sim.core": {"sim.base"},
    "sim.cost": {"sim.base", "sim.core"},
    "sim.results": {"sim.base", "sim.core", "sim.cost"},
    "sim.loop": {"sim.base", "sim.core", "sim.cost"},
    "sim.run": {"sim.base", "sim.core", "sim.cost", "sim.results", "sim.loop", "policies", "workloads"},
    "sim.cli": {"sim.base", "sim.core", "sim.cost", "sim.results", "sim.loop", "sim.run", "policies",
                "workloads", "reports", "calibrate"},
    "policies": {"sim.base", "sim.core"},
    "workloads": {"sim.base"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules ``path`` imports, anywhere in the file (TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
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


def _floor(module: str) -> str:
    """The floor (a key of FLOORS) or top-level package a module belongs to."""
    for floor in sorted(FLOORS, key=len, reverse=True):
        if module == floor or module.startswith(floor + "."):
            return floor
    return module.split(".")[0]


def test_every_module_of_sim_is_on_a_floor() -> None:
    loose = sorted(m for m in _graph() if m.startswith("sim.") and _floor(m) not in FLOORS)
    assert loose == [], f"modules of sim/ outside every floor: {loose}"


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_floor_imports_only_the_floors_below(floor: str) -> None:
    wrong = {m: sorted(d for d in deps if _floor(d) != floor and _floor(d) not in FLOORS[floor])
             for m, deps in _graph().items() if _floor(m) == floor}
    wrong = {m: deps for m, deps in wrong.items() if deps}
    assert wrong == {}, f"upward or sideways arrows from {floor}: {wrong}"


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


def test_the_checker_sees_type_only_imports(tmp_path: Path) -> None:
    """A ``TYPE_CHECKING`` import is an arrow (the old checker left them out, which hid three cycles)."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sim.run.runner import drive\n")
    assert _imports(f, {"sim.run.runner", "sim.run"}) == {"sim.run.runner"}
