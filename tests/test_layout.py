"""The package's layout is its architecture: planes import only the planes below them.

Read from the source (every ``import``, function-level ones included), so a shortcut
taken in a hurry fails here instead of turning the map in ``pd_router/*/__init__.py``
and README's Layout into fiction.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pd_router"

# What each plane may import besides itself (the docstrings of the subpackages say why).
# Top-level modules (app, relay, admin, cli, parser, serve, demo, status, config, workers) are
# where the planes meet and may import any of them; no plane imports them, except ``errors``.
ALLOWED = {
    "fleet": {"errors"},
    "edge": {"errors"},
    "discovery": {"errors", "fleet"},
    "shared": {"errors", "fleet"},
    "engines": {"errors", "fleet", "ops"},
    "ops": {"errors", "fleet", "discovery", "edge"},
    "sim": set(),
    "errors": set(),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pd_router.fleet import pool`` imports the module pd_router.fleet.pool.
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(
                    candidate
                    if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                    else base
                )
    return {name for name in found if name.split(".")[0] == "pd_router"}


def _graph() -> dict[str, set[str]]:
    return {
        _module(path): _imports(path) - {_module(path)}
        for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py"
    }


def _plane(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "pd_router"


def test_no_module_imports_itself_back_through_others() -> None:
    try:
        tuple(TopologicalSorter(_graph()).static_order())
    except CycleError as cycle:
        pytest.fail(f"import cycle between modules: {' -> '.join(cycle.args[1])}")


def test_planes_import_only_the_planes_below_them() -> None:
    wrong = []
    for module, imported in _graph().items():
        plane = _plane(module)
        if plane not in ALLOWED:
            continue  # a top-level module: where the planes meet
        for target in imported:
            other = _plane(target)
            if other != plane and other not in ALLOWED[plane]:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_planes_form_no_cycle() -> None:
    planes: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        planes.setdefault(_plane(module), set()).update(
            _plane(target) for target in imported if _plane(target) != _plane(module)
        )
    try:
        tuple(TopologicalSorter(planes).static_order())
    except CycleError as cycle:
        pytest.fail(f"planes import each other: {' -> '.join(cycle.args[1])}")


def test_every_plane_says_what_it_owns_and_may_import() -> None:
    for plane in ALLOWED:
        init = PACKAGE / plane / "__init__.py"
        if plane in ("errors", "sim"):
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init} does not say what it may import"
