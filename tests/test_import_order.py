"""The top-level packages import each other one way, in the order the README's Layout states:

    core < formats < calib < quant < evalsuite, runner < recipes < bench

A package imports only packages of a lower floor (evalsuite and runner share one and import
neither the other), and core imports nothing of the project. Every import statement counts,
those inside functions too, since a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = {"core": 0, "formats": 1, "calib": 2, "quant": 3, "evalsuite": 4, "runner": 4, "recipes": 5, "bench": 6}


def _imported_packages(path: Path, repo: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import statement in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = path.relative_to(repo).parts[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else (node.module or "").split(".")[0]))
    return found


def _violations(repo: Path = REPO) -> list[str]:
    bad = []
    for package, floor in FLOORS.items():
        for path in sorted((repo / package).rglob("*.py")):
            for line, imported in _imported_packages(path, repo):
                if imported in FLOORS and imported != package and FLOORS[imported] >= floor:
                    bad.append(f"{path.relative_to(repo)}:{line} imports {imported} (floor {FLOORS[imported]}), "
                               f"but {package} is on floor {floor}")
    return bad


def test_packages_import_only_lower_floors():
    assert _violations() == []


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The walk finds a lazy import against the order and resolves a relative one to its own
    package (the check could otherwise pass vacuously)."""
    (tmp_path / "formats").mkdir()
    (tmp_path / "formats" / "lazy.py").write_text("from . import hf\n\ndef f():\n    from recipes.schema import Recipe\n    return Recipe\n")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "up.py").write_text("import quant.gptq\n")
    assert sorted(v.split(" imports ")[1].split()[0] for v in _violations(tmp_path)) == ["quant", "recipes"]


def test_the_floors_are_the_readmes():
    """The README's Layout section states this order, word for word."""
    assert "core < formats < calib < quant < evalsuite, runner < recipes < bench" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_every_package_is_a_folder(package):
    assert (REPO / package).is_dir()
