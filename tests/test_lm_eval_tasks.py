"""lm-eval tasks in a recipe: local task YAMLs run through lm-eval's evaluator score what our own
scorer scores, generation runs on the engine where it runs the variant, and a task that cannot run
offline stops the job before it starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import TINY, write_recipe
from evalsuite.metrics import causal_lm_logprobs
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer
from recipes.schema import BUNDLED_TASKS

# the cloze as a generation task: the first word written after the context, against the target
GENERATED_CLOZE = {
    "task": "gen_cloze",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(BUNDLED_TASKS / "persuasion_cloze.jsonl")}},
    "test_split": "test",
    "output_type": "generate_until",
    "doc_to_text": "{{context}}",
    "doc_to_target": "{{target | trim}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
    "filter_list": [{"name": "first_word", "filter": [{"function": "regex", "regex_pattern": "([A-Za-z']+)"},
                                                     {"function": "take_first"}]}],
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    "metadata": {"version": 1.0},
}


@pytest.fixture(scope="module")
def lm_eval_run(tmp_path_factory) -> dict:
    from rich.console import Console

    from evalsuite.lm_eval_bridge import write_local_task_yaml
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    folder = tmp_path_factory.mktemp("lm_eval_run")
    write_local_task_yaml("yaml_order", BUNDLED_TASKS / "persuasion_order.jsonl", folder / "tasks")
    (folder / "tasks" / "gen_cloze.yaml").write_text(yaml.safe_dump(GENERATED_CLOZE), encoding="utf-8")
    recipe = {
        "model": str(TINY),
        "evaluation": {"text": str(TINY.parent / "eval.txt"), "window": 128, "max_windows": 2,
                       "tasks": [{"task": "persuasion_order", "limit": 24}, {"task": "tasks/yaml_order.yaml", "limit": 24},
                                 {"task": "tasks/gen_cloze.yaml", "limit": 16}]},
        "variants": [
            {"name": "int4-ct", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64},
             "exports": ["compressed-tensors"]},
            {"name": "int4-dense", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}},
        ],
    }
    run_recipe(load_recipe(write_recipe(folder, recipe)), folder / "out", Console(quiet=True))
    report = json.loads((folder / "out" / "report.json").read_text())
    return {"rows": {r["name"]: r for r in report["variants"]}, "folder": folder}


def test_a_task_yaml_through_lm_eval_scores_what_our_scorer_scores(lm_eval_run):
    for name, row in lm_eval_run["rows"].items():
        ours, theirs = row["tasks"]["persuasion_order"], row["tasks"]["yaml_order"]
        assert theirs["correct"] == ours["correct"] and len(ours["correct"]) == 24, name
        assert theirs["chance"] == ours["chance"] == 0.25 and theirs["metric"] == "acc"
        if name != "original":
            assert theirs["right_to_wrong"] == ours["right_to_wrong"]
    assert lm_eval_run["rows"]["original"]["tasks"]["yaml_order"]["accuracy"] > 0.5


def test_generation_runs_on_the_engine_where_it_runs_the_variant(lm_eval_run):
    from recipes import lm_eval_tasks
    from recipes.lm_eval_tasks import LMEvalTask

    rows = lm_eval_run["rows"]
    generated = {name: row["tasks"]["gen_cloze"] for name, row in rows.items()}
    assert generated["original"]["generated_by"] == generated["int4-ct"]["generated_by"] == lm_eval_tasks.ENGINE
    assert generated["int4-dense"]["generated_by"] == lm_eval_tasks.EVALUATED  # no export the engine runs
    assert generated["original"]["metric"] == "exact_match" and sum(generated["original"]["correct"]) >= 3
    # the engine's greedy answers for the original are those of transformers' model, one by one
    (task,) = lm_eval_tasks.prepare([_spec(lm_eval_run["folder"] / "tasks" / "gen_cloze.yaml", 16)])
    assert isinstance(task, LMEvalTask)
    ckpt = HFCheckpoint.open(TINY)
    tokenizer = load_tokenizer(ckpt)
    direct = lm_eval_tasks.run(task, causal_lm_logprobs(load_causal_lm(ckpt)), tokenizer, 2048, ckpt.arch.vocab, 0)
    assert direct["generated_by"] == lm_eval_tasks.EVALUATED
    assert direct["correct"] == generated["original"]["correct"]


def _spec(path, limit):
    from recipes.schema import TaskSpec

    return TaskSpec(task=str(path), limit=limit)


@pytest.mark.parametrize("task, message", [
    ("arc_easy", "lm-eval task 'arc_easy': cannot load it offline"),
    ("persuasion_clozee", "task 'persuasion_clozee': not a bundled task (persuasion_cloze, persuasion_order) "
                          "nor a task or group lm-eval knows"),
])
def test_a_task_that_cannot_run_here_stops_the_job_in_one_line(tmp_path, task, message):
    recipe = {"model": str(TINY), "evaluation": {"text": str(TINY.parent / "eval.txt"), "tasks": [task]},
              "variants": [{"name": "int8", "weights": {"method": "rtn", "bits": 8}}]}
    path = write_recipe(tmp_path, recipe)
    run = subprocess.run([sys.executable, "-m", "recipes.cli", str(path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_report_says_what_generated_and_documents_it(lm_eval_run):
    from pathlib import Path

    md = (lm_eval_run["folder"] / "out" / "report.md").read_text()
    assert "## Task: gen_cloze: 16 examples, scored by lm-eval's exact_match" in md
    assert "| text generated by |" in md and "| int4-dense |" in md and "| evaluated model |" in md
    schema = (Path(__file__).parent.parent / "docs" / "report.md").read_text().split("## `report.json`")[1]
    fields = {k for row in lm_eval_run["rows"].values() for t in row["tasks"].values() for k in t}
    assert {"metric", "generated_by"} <= fields and all(f in schema for f in fields)
