"""The top-level packages import each other one way, in the order the README's Layout states:

    core < formats < calib < quant < evalsuite, runner < recipes < bench

A package imports only packages of a lower floor (evalsuite and runner share one and import
neither the other), and core imports nothing of the project. Every import statement counts,
those inside functions too, since a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

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


# ---------------------------------------------------------------- tests/: no test module imports another

TESTS = REPO / "tests"


def _test_module_imports(tests: Path = TESTS) -> list[str]:
    """Every import of a test module (tests/test_*.py) by a test module or a helper, as
    'file:line imports module'; also pytest.importorskip("test_..."). Shared helpers and fixtures
    live in tests/conftest.py and tests/helpers/: importing a test module runs its module-level code
    (fixtures, parametrizations, skips) a second time under another name, and ties one module's
    tier and collection to another's."""
    modules = {p.stem for p in tests.glob("test_*.py")}
    bad = []
    for path in sorted([*tests.glob("test_*.py"), *tests.glob("helpers/*.py"), tests / "conftest.py"]):
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("importorskip", "import_module")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if top in modules or top.startswith("test_") or name.startswith("tests.test_"):
                    bad.append(f"{path.relative_to(tests.parent)}:{node.lineno} imports {name}")
    return bad


def test_no_test_module_imports_another():
    assert _test_module_imports() == []


def test_the_layout_check_sees_every_form_of_import(tmp_path):
    (tmp_path / "helpers").mkdir()
    (tmp_path / "test_a.py").write_text("from test_b import x\n\ndef test_x():\n    import test_b\n")
    (tmp_path / "test_b.py").write_text("import pytest\nc = pytest.importorskip('test_a')\nfrom helpers.h import y\n")
    (tmp_path / "helpers" / "h.py").write_text("from test_a import z\n")
    found = [v.split(":")[0] + ":" + v.split(" imports ")[1] for v in _test_module_imports(tmp_path)]
    assert sorted(found) == [f"{tmp_path.name}/helpers/h.py:test_a", f"{tmp_path.name}/test_a.py:test_b",
                             f"{tmp_path.name}/test_a.py:test_b", f"{tmp_path.name}/test_b.py:test_a"]
