"""The two tiers (docs/testing.md): `make check` runs the tests marked `check` and no `anchor` test,
and still touches every subsystem the README's Quick start names; `make test` runs everything.
Read from the sources (ast), not by collecting, so this costs nothing in the fast tier."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

REPO = Path(__file__).resolve().parents[1]

# what the fast tier must hold: (module, test function) per subsystem
SUBSYSTEMS = {
    "a K-quant file byte for byte against llama.cpp's quantizer": ("test_gguf_exact", "test_every_tensor_matches_llama_quantize"),
    "a recipe end to end on the bundled model": ("test_pipeline", "test_rerun_keeps_finished_variants_and_redoes_what_changed"),
    "the engine's greedy tokens against transformers": ("test_engine", "test_greedy_tokens_equal_transformers_generate"),
    "the CPU decode-attention kernel against float64 attention": ("test_cpu_attention", "test_the_kernel_computes_attention_over_the_blocks_where_they_lie"),
    "the server under the openai client": ("test_server", "test_a_completion_is_what_the_engine_computes"),
    "damaged GGUF files refused in one line": ("test_damaged_files", "test_inspect_refuses_what_llama_cpp_refuses"),
    "damaged safetensors headers refused in one line": ("test_damaged_files", "test_damaged_safetensors_headers_get_one_line"),
    "a Hugging Face id from a cache the test writes": ("test_hub", "test_a_missing_id_offline_is_one_line_naming_it_and_the_cache"),
    "the packages' import floors": ("test_import_order", "test_packages_import_only_lower_floors"),
    "the export formats' and weight methods' registries": ("test_registries", "test_the_recipe_exports_are_the_registered_formats"),
    "a type: auto GGUF file within its budget, run by llama.cpp": ("test_auto_mix", "test_auto_file_keeps_its_budget_and_llama_cpp_runs_it"),
    "bits: auto's grids within their budget": ("test_bit_search", "test_a_tighter_budget_keeps_fewer_linears_in_8_bits"),
    "a tokenizer.json SentencePiece BPE as GGUF pieces": ("test_gguf_architectures", "test_tokenizer_json_pieces_are_scored_by_merge_and_typed"),
}


def _is_check(node: ast.AST) -> bool:
    """``pytest.mark.check`` itself, or anything holding it (a list, a pytest.param's marks)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "check" and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
               for n in ast.walk(node))


def in_fast_tier(module: str, function: str) -> bool:
    """Some case of ``function`` is marked check: by the module's pytestmark, a decorator, a
    pytest.param's marks, or the module's CHECK_CASES."""
    tree = ast.parse((REPO / "tests" / f"{module}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets) and _is_check(node.value):
            return True
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHECK_CASES" for t in node.targets):
            if any(isinstance(c, ast.Constant) and str(c.value).startswith(function + "[") for c in ast.walk(node.value)):
                return True
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return any(_is_check(d) for d in node.decorator_list)
    return False


@pytest.mark.parametrize("subsystem", SUBSYSTEMS)
def test_the_fast_tier_touches_every_subsystem(subsystem):
    assert in_fast_tier(*SUBSYSTEMS[subsystem]), f"{subsystem}: {SUBSYSTEMS[subsystem]} is not marked check"


def test_the_fast_tier_check_sees_each_way_of_marking(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(
        "import pytest\nCHECK_CASES = {'test_c[x-y]'}\n\n@pytest.mark.check\ndef test_a(): pass\n\n"
        "@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.check), 2])\ndef test_b(n): pass\n\n"
        "def test_c(): pass\n\n@pytest.mark.anchor\ndef test_d(): pass\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert [in_fast_tier("test_m", f) for f in ("test_a", "test_b", "test_c", "test_d")] == [True, True, True, False]


def test_make_check_runs_the_fast_tier_and_make_test_everything():
    makefile = (REPO / "Makefile").read_text()
    targets = dict(re.findall(r"^([\w.$()/-]+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M))
    assert 'pytest tests -m "check and not anchor"' in targets["check"]
    assert "anchors/setup.sh" not in targets["check"]  # no anchor venv, no browser
    assert targets["test"].rstrip().endswith("-m pytest tests")  # the whole suite, after the anchors' setups
    assert re.search(r"^check: \$\(VENV\)/\.test$", makefile, re.M)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "--strict-markers" in pyproject and '"check:' in pyproject and '"anchor:' in pyproject
