"""Models named as users name them (formats/hub.py): a Hugging Face id resolves through a cache the
test writes itself, in huggingface_hub's layout, offline; a path that exists stays a path; a missing
id is one line. And the model card every recipe variant gets (recipes/model_card.py)."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from conftest import EVAL_TEXT, REPO, TINY, write_recipe
from core.errors import InputError
from formats.hub import HubId, hub_id, local_model, parse_hub_id
from helpers.cli import assert_user_error, quantize

MAIN = "1" * 40  # the commit refs/main names
V2 = "2" * 40  # another snapshot, tagged v2

RECIPE = {
    "model": "org/tiny",
    "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 2},
    "variants": [
        {"name": "int8", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors", "compressed-tensors"]},
        {"name": "q8_0", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]},
    ],
}


def cached(root: Path, repo: str, commit: str, files: list[Path], ref: str = "main") -> Path:
    """A repository's snapshot in huggingface_hub's cache layout (models--org--name/snapshots/<commit>,
    refs/<ref> holding the commit), its files links to ``files`` as the cache's links to its blobs."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in files:
        (snapshot / f.name).symlink_to(f)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


def offline_cache(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """Point huggingface_hub at ``root``, offline (it reads the variables once, at import: its
    constants are set too)."""
    import huggingface_hub.constants

    root.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    return offline_cache(monkeypatch, tmp_path / "hf-cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The recipe run from the id ``org/tiny`` (in a cache made here) and from the bundled folder,
    then the id's run again into the same folder."""
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    folder = tmp_path_factory.mktemp("hub_runs")
    with pytest.MonkeyPatch.context() as mp:
        cached(offline_cache(mp, folder / "hf-cache"), "org/tiny", MAIN, sorted(TINY.iterdir()))
        by_id = load_recipe(write_recipe(folder, RECIPE, "by_id.yaml"))
        local = load_recipe(write_recipe(folder, RECIPE | {"model": str(TINY)}, "local.yaml"))
        run_recipe(by_id, folder / "by_id", Console(quiet=True))
        first = json.loads((folder / "by_id" / "report.json").read_text())
        done = {v: (folder / "by_id" / v / ".done.json").stat().st_mtime_ns for v in ("int8", "q8_0")}
        run_recipe(local, folder / "local", Console(quiet=True))
        rerun_log = io.StringIO()
        run_recipe(by_id, folder / "by_id", Console(file=rerun_log, width=200))
    return {"out": folder / "by_id", "first": first, "done": done, "rerun_log": rerun_log.getvalue(),
            "by_id": json.loads((folder / "by_id" / "report.json").read_text()),
            "local": json.loads((folder / "local" / "report.json").read_text())}


@pytest.mark.check  # the fast tier (docs/testing.md)
def test_ids_are_shaped_org_name_at_revision():
    assert parse_hub_id("org/name") == HubId("org/name")
    assert parse_hub_id("Org-1/name.v2_x@refs/pr/1") == HubId("Org-1/name.v2_x", "refs/pr/1")
    for path in ("name", "./org/name", "/org/name", "org/name/file.gguf", "org--x/name", "org/..", "org/name@", "a b/c"):
        assert parse_hub_id(path) is None, path


def test_a_recipe_runs_from_an_id_with_the_scores_of_the_local_folder(runs):
    by_id, local = runs["by_id"], runs["local"]
    assert by_id["model"] == "org/tiny"
    assert [v["name"] for v in by_id["variants"]] == ["original", "int8", "q8_0"]
    for a, b in zip(by_id["variants"], local["variants"]):
        assert (a["ppl"], a["kld"], a["top1"], a["size_mb"], a["bits_per_weight"]) == \
               (b["ppl"], b["kld"], b["top1"], b["size_mb"], b["bits_per_weight"])
        assert a["files"] == b["files"]  # the GGUF named after the repository, not its commit
    assert (runs["out"] / "q8_0" / "tiny-Q8_0.gguf").is_file()


@pytest.mark.check  # the fast tier (docs/testing.md)
def test_a_revision_picks_its_snapshot(cache):
    main = cached(cache, "org/tiny", MAIN, sorted(TINY.iterdir()))
    v2 = cached(cache, "org/tiny", V2, [TINY / "config.json"], ref="v2")
    assert local_model("org/tiny") == main
    assert local_model("org/tiny@v2") == v2 == local_model(f"org/tiny@{V2}")
    assert local_model(f"org/tiny@{MAIN}") == main


@pytest.mark.check  # the fast tier (docs/testing.md)
def test_a_missing_id_offline_is_one_line_naming_it_and_the_cache(cache, monkeypatch, capsys, tmp_path):
    recipe = write_recipe(tmp_path, RECIPE | {"model": "org/missing"})
    assert_user_error(quantize(monkeypatch, capsys, recipe, "--out", tmp_path / "out"), "org/missing", str(cache), "offline")
    assert_user_error(quantize(monkeypatch, capsys, "export", "org/missing@v9", "--gguf", "Q8_0", "-o", tmp_path / "x.gguf"),
                      "org/missing@v9", str(cache))
    with pytest.raises(InputError, match="org/missing"):
        local_model("org/missing", config_only=True)


def test_a_missing_id_offline_in_a_fresh_process(tmp_path):
    """The variables alone, as a user sets them, reach huggingface_hub: exit 2, one line, no traceback."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "COLUMNS": "300"}
    proc = subprocess.run([sys.executable, "-m", "recipes.cli", "fit", "org/missing"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "org/missing" in lines[0] and str(tmp_path) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("error, config_only, fragment", [
    ("GatedRepoError", False, "a gated repository; accept its terms at https://huggingface.co/org/x"),
    ("RepositoryNotFoundError", False, "nor a repository on the Hugging Face Hub"),
    ("RevisionNotFoundError", False, "no revision 'v9'"),
    ("RemoteEntryNotFoundError", True, "the repository has no config.json"),
    ("HfHubHTTPError", False, "the Hugging Face Hub refused"),
    ("LocalEntryNotFoundError", False, "the Hugging Face Hub cannot be reached"),
])
def test_every_failure_online_is_one_line_naming_the_id(monkeypatch, tmp_path, error, config_only, fragment):
    """huggingface_hub's errors as it raises them online (its downloads replaced by one that fails)."""
    import httpx2
    import huggingface_hub
    import huggingface_hub.errors

    offline_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    cls = getattr(huggingface_hub.errors, error)
    response = httpx2.Response(403, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))
    failure = cls("the Hub said no") if error == "LocalEntryNotFoundError" else cls("the Hub said no", response=response)

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(huggingface_hub, "hf_hub_download" if config_only else "snapshot_download", fail)
    with pytest.raises(InputError, match=fragment) as caught:
        local_model("org/x@v9", config_only=config_only)
    assert str(caught.value).startswith("org/x@v9: ") and "\n" not in str(caught.value)


@pytest.mark.check  # the fast tier (docs/testing.md)
def test_fit_needs_only_the_config_in_the_cache(cache, monkeypatch, capsys):
    cached(cache, "org/tiny", MAIN, [TINY / "config.json"])
    code, out, err = quantize(monkeypatch, capsys, "fit", "org/tiny", "--json")
    assert code == 0, err
    code, local, err = quantize(monkeypatch, capsys, "fit", TINY, "--json")
    assert code == 0, err
    by_id, local = json.loads(out), json.loads(local)
    assert by_id["model"] == "org/tiny" and by_id["parameters"] == local["parameters"] > 0


@pytest.mark.check  # the fast tier (docs/testing.md)
def test_an_existing_path_shaped_like_an_id_is_a_path(cache, monkeypatch, capsys, tmp_path):
    """The cache is empty and offline: only the local folder can answer."""
    folder = tmp_path / "org" / "tiny"
    folder.mkdir(parents=True)
    for f in TINY.iterdir():
        (folder / f.name).symlink_to(f)
    monkeypatch.chdir(tmp_path)
    assert hub_id("org/tiny") is None and local_model("org/tiny") == Path("org/tiny")
    code, out, err = quantize(monkeypatch, capsys, "fit", "org/tiny", "--json")
    assert code == 0, err
    from recipes.schema import load_recipe

    recipe_dir = tmp_path / "recipes"
    (recipe_dir / "org").mkdir(parents=True)
    (recipe_dir / "org" / "tiny").symlink_to(TINY)
    assert load_recipe(write_recipe(recipe_dir, RECIPE)).model == recipe_dir / "org" / "tiny"  # relative to the recipe
    by_id = load_recipe(write_recipe(tmp_path / "org", RECIPE | {"model": "org/other", "reference": "org/ref@v1"}))
    assert (by_id.model, by_id.reference) == (Path("org/other"), Path("org/ref@v1"))  # ids, as written


def card(out: Path, variant: str) -> tuple[dict, str]:
    text = (out / variant / "README.md").read_text(encoding="utf-8")
    _, header, body = text.split("---\n", 2)
    return yaml.safe_load(header), body


def test_every_variant_gets_a_model_card_with_the_reports_scores(runs):
    out = runs["out"]
    rows = {r["name"]: r for r in runs["by_id"]["variants"]}
    for name, library, method in (("int8", "transformers", "rtn"), ("q8_0", "gguf", "gguf")):
        meta, body = card(out, name)
        assert meta["base_model"] == "org/tiny" and meta["quantized_by"] == "quantbench"
        assert meta["library_name"] == library and method in meta["tags"]
        assert meta["quantization"]["method"] == method
        assert meta["quantization"]["bits_per_weight"] == round(rows[name]["bits_per_weight"], 3)
        r = rows[name]
        line = next(line for line in body.splitlines() if line.startswith(f"| {name} |"))
        for value in (f"{r['bits_per_weight']:.2f}", f"{r['size_mb']:.2f}", f"{r['ppl']:.3f}",
                      f"{round(r['ppl_delta'], 3) + 0.0:+.3f}", f"{r['kld']:.5f}", f"{100 * r['top1']:.2f}%"):
            assert f"| {value} |" in line, (value, line)
    _, int8 = card(out, "int8")
    assert 'from_pretrained("safetensors")' in int8 and 'from_pretrained("compressed-tensors")' in int8
    assert "vllm serve ./compressed-tensors" in int8
    assert "llama.cpp cannot load this variant" in int8 and "Ollama cannot load this variant without conversion" in int8
    assert "quantize export ./compressed-tensors --gguf Q8_0 -o int8-Q8_0.gguf" in int8
    assert "ollama create int8 -f int8-Q8_0.Modelfile" in int8
    _, q8 = card(out, "q8_0")
    assert "llama-cli -m tiny-Q8_0.gguf" in q8 and "ollama create q8_0 -f tiny-Q8_0.Modelfile" in q8
    assert "transformers cannot load this variant" in q8 and "vLLM cannot load this variant" in q8


def test_the_card_changes_no_size_and_a_rerun_rebuilds_nothing(runs):
    from recipes.resume import path_size

    out = runs["out"]
    assert runs["by_id"]["variants"] == runs["first"]["variants"]  # kept rows, sizes and all
    for name in ("int8", "q8_0"):
        assert f"{name}: unchanged since it last finished" in runs["rerun_log"]
        assert (out / name / ".done.json").stat().st_mtime_ns == runs["done"][name]
        assert (out / name / "README.md").is_file()
    for f in runs["by_id"]["variants"][1]["files"]:
        assert "README.md" not in f["path"] and f["bytes"] == path_size(out / f["path"])


@pytest.mark.check  # the fast tier (docs/testing.md)
def test_no_module_puts_the_process_offline_on_import():
    """Setting HF_HUB_OFFLINE at import would stop every later download in the process (a model id,
    formats/hub.py): only code that runs (a function, a script's main block) may set it."""
    offenders = []
    for package in ("core", "formats", "calib", "quant", "evalsuite", "runner", "recipes", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                    continue
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
                    continue
                if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                    continue
                if "OFFLINE" in ast.unparse(node):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_lm_eval_goes_offline_only_while_it_runs(monkeypatch):
    pytest.importorskip("lm_eval")
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    from evalsuite.lm_eval_bridge import offline

    with offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE
    assert "HF_HUB_OFFLINE" not in os.environ and not constants.HF_HUB_OFFLINE
