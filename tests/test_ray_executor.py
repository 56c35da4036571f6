"""Recipe jobs on Ray (recipes/ray_executor.py): six variants on a local Ray of two workers give
the report.json of a local run, timings aside, with a worker killed mid-task (Ray redoes its
variant) and after a job whose task died for good (a rerun keeps what finished and redoes the
rest); the variants' files are the local run's, byte for byte (a task computes on the driver's
torch threads: GPTQ's float32 sums depend on the thread count)."""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from conftest import BUNDLED, EVAL_TEXT, TINY, write_recipe
from helpers.cli import assert_user_error, quantize

GPTQ = "gptq-int4-g64"  # the slowest variant: the one whose worker is killed
SIX = {
    "model": str(TINY),
    "evaluation": {"text": str(EVAL_TEXT), "window": 256, "max_windows": 2},
    "calibration": {"text": str(BUNDLED / "calib.txt"), "window": 256, "max_windows": 4},
    "executor": "ray",
    "variants": [
        {"name": "int8", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors"]},
        {"name": "int4-g64", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}},
        {"name": GPTQ, "weights": {"method": "gptq", "bits": 4, "group_size": 64}, "exports": ["gptq"]},
        {"name": "q8_0", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]},
        {"name": "kv-int4", "weights": {"method": "none"}, "kv_cache": {"format": "int4"}},
        {"name": "awq-int4-g64", "weights": {"method": "awq", "bits": 4, "group_size": 64}},
    ],
}


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("ray"), SIX)


@pytest.fixture(scope="module")
def local_run(recipe_path) -> Path:
    """The recipe run locally, as the CLI's --executor local runs it."""
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    out = recipe_path.parent / "local"
    run_recipe(load_recipe(recipe_path), out, Console(quiet=True), "local")
    return out


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of two workers for the module; the jobs join it rather than start their own."""
    ray = pytest.importorskip("ray", reason="ray is the 'ray' extra, in 'dev' (make test installs it)")
    ray.init(num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()


def without_timings(out: Path) -> dict:
    """report.json less what measures time: each row's ``seconds`` (the wall time of building and
    scoring it) and ``speed`` (measured throughput; null here, as the recipe asks for none)."""
    report = json.loads((out / "report.json").read_text())
    for row in report["variants"]:
        del row["seconds"], row["speed"]
    return report


def variant_files(out: Path) -> dict[Path, bytes]:
    """Every file the job wrote but its report and bookkeeping (records, the reference store)."""
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and not p.name.startswith(".") and not p.name.startswith("report")
            and ".reference" not in p.parts}


def kill_workers(out: Path, variant: str, times: int) -> tuple[threading.Thread, list[int]]:
    """A thread that SIGKILLs the worker of ``variant``'s task once it is mid-work (its staged
    files on disk), ``times`` times (each retry's worker in turn); the pids it killed."""
    killed: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 900  # a loaded machine takes minutes to reach the task
        while len(killed) < times and time.monotonic() < deadline:
            try:
                pid = json.loads((out / f".{variant}.worker").read_text())["pid"]
            except (OSError, ValueError):
                pid = None
            if pid is not None and pid not in killed and list((out / variant).glob(f"*.{pid}.partial")):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


def test_six_variants_on_two_workers_report_as_a_local_run_with_a_worker_killed(recipe_path, local_run, local_ray, tmp_path):
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    out = tmp_path / "ray"
    log = io.StringIO()
    thread, killed = kill_workers(out, GPTQ, times=1)
    run_recipe(load_recipe(recipe_path), out, Console(file=log, width=200))
    thread.join(1)
    assert len(killed) == 1, log.getvalue()
    lines = log.getvalue().splitlines()
    for v in SIX["variants"]:
        assert f"{v['name']}: finished on Ray" in log.getvalue(), log.getvalue()
    assert any(line.startswith(f"{GPTQ}: started on Ray") and "again: its previous worker died" in line
               for line in lines), log.getvalue()
    assert without_timings(out) == without_timings(local_run)
    assert variant_files(out) == variant_files(local_run)
    assert not list(out.rglob("*.partial")) and not list(out.glob(".*.worker"))


def test_a_job_whose_task_keeps_dying_resumes_on_a_rerun(recipe_path, local_run, local_ray, tmp_path):
    """Every worker of the GPTQ task killed (the first try and Ray's retries): the job fails, the
    variants that finished are recorded, and a rerun keeps them and builds the rest."""
    from recipes.pipeline import run_recipe
    from recipes.ray_executor import _RETRIES
    from recipes.resume import RECORD
    from recipes.schema import load_recipe

    out = tmp_path / "ray"
    thread, killed = kill_workers(out, GPTQ, times=1 + _RETRIES)
    with pytest.raises(local_ray.exceptions.RayError):
        run_recipe(load_recipe(recipe_path), out, Console(quiet=True))
    thread.join(1)
    assert len(killed) == 1 + _RETRIES
    recorded = sorted(v["name"] for v in SIX["variants"] if (out / v["name"] / RECORD).exists())
    assert GPTQ not in recorded and not (out / "report.json").exists()
    log = io.StringIO()
    run_recipe(load_recipe(recipe_path), out, Console(file=log, width=200))
    kept = sorted(line.split(":")[0] for line in log.getvalue().splitlines() if ": unchanged since it last finished" in line)
    assert recorded and kept == recorded
    assert without_timings(out) == without_timings(local_run)
    assert variant_files(out) == variant_files(local_run)


def test_executor_ray_without_ray_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # what importlib then finds: no ray
    recipe = copy.deepcopy(SIX) | {"executor": "local"}
    assert_user_error(quantize(monkeypatch, capsys, write_recipe(tmp_path, recipe), "--executor", "ray", "--out", tmp_path / "o"),
                      "executor ray: ray is not installed (pip install 'quantbench[ray]')")
    assert not (tmp_path / "o").exists()


def test_an_unknown_executor_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    assert_user_error(quantize(monkeypatch, capsys, write_recipe(tmp_path, SIX | {"executor": "dask"})),
                      "field 'executor'", "'dask' is not local, ray or ray=ADDRESS")
    assert_user_error(quantize(monkeypatch, capsys, write_recipe(tmp_path, SIX), "--executor", "ray="),
                      "--executor: 'ray=' is not local, ray or ray=ADDRESS")
