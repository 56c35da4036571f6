"""Task accuracy, flips and paired intervals: the bundled tasks on the bundled model, end to end."""

import json
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from conftest import TINY, write_recipe
from core.errors import InputError
from evalsuite.loglikelihood import continuation_logprobs, encode_pair
from evalsuite.metrics import causal_lm_logprobs
from evalsuite.paired import spans_zero, task_comparison
from evalsuite.tasks import load_task, run_task
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer
from recipes.schema import BUNDLED_TASKS

TASK_RECIPE = {
    "model": str(TINY),
    "evaluation": {"text": str(TINY.parent / "eval.txt"), "window": 256, "max_windows": 8,
                   "tasks": [{"task": "persuasion_cloze", "limit": 120}, {"task": "persuasion_order", "limit": 120}]},
    "variants": [
        {"name": "int8", "weights": {"method": "rtn", "bits": 8, "granularity": "channel"}},
        {"name": "int2-g32", "weights": {"method": "rtn", "bits": 2, "granularity": "group", "group_size": 32}},
    ],
    "budget": {"kld": 0.01, "task_drop": "2%"},
}


@pytest.fixture(scope="module")
def task_run(tmp_path_factory) -> dict:
    """The report's rows by variant name, and the run's folder under "out"."""
    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    folder = tmp_path_factory.mktemp("task_run")
    run_recipe(load_recipe(write_recipe(folder, TASK_RECIPE)), folder / "out", Console(quiet=True))
    rows = {r["name"]: r for r in json.loads((folder / "out" / "report.json").read_text())["variants"]}
    return dict(rows, out=folder / "out")


def test_the_original_scores_well_above_chance_on_every_bundled_task(task_run):
    tasks = task_run["original"]["tasks"]
    assert set(tasks) == {"persuasion_cloze", "persuasion_order"}
    assert tasks["persuasion_order"]["chance"] == 0.25 and tasks["persuasion_order"]["accuracy"] > 0.75
    assert tasks["persuasion_cloze"]["chance"] == 0.0 and tasks["persuasion_cloze"]["accuracy"] > 0.1
    for t in tasks.values():
        lo, hi = t["interval"]
        assert lo < t["accuracy"] < hi and len(t["correct"]) == 120


def test_a_variant_within_noise_is_labelled_so_and_a_damaged_one_flips_answers(task_run):
    close, far = task_run["int8"], task_run["int2-g32"]
    assert close["distinguishable"] is False
    lo, hi = close["intervals"]["ppl_delta"]
    assert lo <= 0 <= hi
    assert far["distinguishable"] is True
    assert far["intervals"]["ppl_delta"][0] > 0 and far["intervals"]["kld"][0] > 10 * close["intervals"]["kld"][1]
    flips = sum(len(t["right_to_wrong"]) + len(t["wrong_to_right"]) for t in far["tasks"].values())
    assert flips > sum(len(t["right_to_wrong"]) + len(t["wrong_to_right"]) for t in close["tasks"].values())
    assert far["tasks"]["persuasion_order"]["delta_interval"][1] < 0  # 2-bit loses the word-order task for sure
    for name, t in far["tasks"].items():  # the flips are the changes in the answers, example by example
        orig = task_run["original"]["tasks"][name]
        pairs = list(zip(orig["correct"], t["correct"]))
        assert t["right_to_wrong"] == [i for i, (o, v) in enumerate(pairs) if o and not v]
        assert t["wrong_to_right"] == [i for i, (o, v) in enumerate(pairs) if v and not o]
        assert t["delta"] == pytest.approx(t["accuracy"] - orig["accuracy"])


def test_the_report_shows_intervals_flips_and_the_verdict(task_run):
    text = (task_run["out"] / "report.md").read_text()
    assert "## Against the original" in text and "| int8 |" in text
    assert "not distinguishable from the original" in text
    assert "## Task: persuasion_order: 120 examples, chance 25.0%" in text
    assert "## Recommendation\n\n- Ship int8. int8 is the smallest variant within the budget" in text
    assert "- int2-g32 misses: KLD " in text


def test_task_scores_match_transformers_logits_directly():
    """The batched, padded scorer against one unpadded forward per request."""
    ckpt = HFCheckpoint.open(TINY)
    model, tok = load_causal_lm(ckpt), load_tokenizer(ckpt)
    task = load_task(BUNDLED_TASKS / "persuasion_order.jsonl", limit=3)
    requests = [encode_pair(tok, e["context"], c, 0) for e in task.examples for c in e["choices"]]
    got = continuation_logprobs(causal_lm_logprobs(model), requests, 2048, ckpt.arch.vocab)
    for (ctx, cont), (lp, greedy) in zip(requests, got):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(cont)[:, None]).sum().item()
        assert lp == pytest.approx(want, abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == torch.tensor(cont)).all())
    assert run_task(causal_lm_logprobs(model), tok, task, 2048, ckpt.arch.vocab, 0) == [
        max(range(4), key=lambda j: got[4 * i + j][0]) == e["gold"] for i, e in enumerate(task.examples)]


def test_paired_comparison_counts_flips_both_ways():
    got = task_comparison([True, True, False, False, True], [True, False, True, False, True])
    assert got["right_to_wrong"] == [1] and got["wrong_to_right"] == [2] and got["delta"] == 0.0
    lo, hi = got["delta_interval"]
    assert lo < 0 < hi
    assert spans_zero([-3e-9, -1e-9]) and not spans_zero([0.001, 0.02]) and not spans_zero([])  # rounding is no change


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not JSON"),
    ('{"context": "a", "choices": ["x", "y"], "gold": 2}', "line 2: 'gold' must be the index"),
    ('{"context": "a"}', "line 2: an example needs 'choices' and 'gold', or a non-empty 'target'"),
])
def test_a_bad_task_file_names_its_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"context": "a", "target": " b"}\n' + line + "\n")
    with pytest.raises(InputError, match=message):
        load_task(path)


def test_a_missing_task_fails_the_recipe_in_one_line(tmp_path):
    recipe = dict(TASK_RECIPE, evaluation=dict(TASK_RECIPE["evaluation"], tasks=["no_such_task.jsonl"]))
    path = write_recipe(tmp_path, recipe)
    run = subprocess.run([sys.executable, "-m", "recipes.cli", str(path)], capture_output=True, text=True)
    assert run.returncode != 0
    assert "no_such_task" in run.stderr and "cannot read task file" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.anchor  # Debian's chromium
def test_the_real_report_reads_in_a_browser(task_run):
    """The run's report.html in headless chromium: clean console, self-contained, one mark per
    variant on the size chart and per model on each task chart; the screenshot is kept."""
    from helpers.browser import check_page, overlaps

    results = Path(__file__).parent.parent / "test-results"
    results.mkdir(exist_ok=True)
    page = check_page(task_run["out"] / "report.html", results / "report-tasks.png")
    assert page.console_errors == [] and page.page_errors == [] and page.failed_requests == []
    assert sorted(page.chart("size-kld").variants) == ["int2-g32", "int8"]
    for task in ("persuasion_cloze", "persuasion_order"):
        assert sorted(page.chart("task-accuracy", task=task).variants) == ["int2-g32", "int8", "original"]
    assert overlaps(page.chart("size-kld")) == []
    assert (results / "report-tasks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_puts_two_runs_side_by_side(task_run, tmp_path):
    other = json.loads((task_run["out"] / "report.json").read_text())
    other["variants"] = [v for v in other["variants"] if v["name"] != "int8"] + [dict(other["variants"][1], name="int6", ppl=61.5)]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps(other))
    md = tmp_path / "compare.md"
    run = subprocess.run([sys.executable, "-m", "recipes.cli", "compare", str(task_run["out"]), str(tmp_path / "b"),
                          "--out", str(md)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    lines = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in md.read_text().splitlines() if line.startswith("| ")}
    head = lines["variant"]
    assert head[1:5] == ["size MB A", "size MB B", "PPL A", "PPL B"] and "persuasion_order B" in head[-1]
    assert lines["int8"][head.index("PPL B")] == "—" and lines["int6"][head.index("PPL A")] == "—"
    assert lines["int6"][head.index("PPL B")] == "61.500"
    assert lines["original"][head.index("PPL A")] == lines["original"][head.index("PPL B")] != "—"
    (tmp_path / "bad.json").write_text("[1, 2]")
    run = subprocess.run([sys.executable, "-m", "recipes.cli", "compare", str(task_run["out"]), str(tmp_path / "bad.json")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "bad.json: not a quantbench report.json" in run.stderr and "Traceback" not in run.stderr


def test_every_field_of_report_json_is_documented(task_run):
    doc = (Path(__file__).parent.parent / "docs" / "report.md").read_text()
    schema = doc[doc.index("## `report.json`"):]
    report = json.loads((task_run["out"] / "report.json").read_text())
    fields = set(report) | set(report["evaluation"]) | set(report["recommendation"]) | set(report["recommendation"]["budget"])
    for row in report["variants"]:
        fields |= set(row) | set(row["per_window"]) | set(row["intervals"])
        fields |= {k for t in row["tasks"].values() for k in t}
    missing = sorted(f for f in fields if f not in schema)
    assert missing == []
