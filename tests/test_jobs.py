"""Recipe jobs and exports against bad output paths, a second job, kill -9 and stray processes.

Every bad output path is refused before any model is loaded; a job holds its output folder; a
killed job leaves no process behind, its lock is taken over, its partial files are swept, and the
rerun's files equal those of a run that was never interrupted."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, SMALL_RECIPE, TINY, write_recipe
from helpers.cli import assert_user_error, quantize
from helpers.processes import tagged_processes


def small_recipe(**changes) -> dict:
    recipe = copy.deepcopy(SMALL_RECIPE)
    recipe["evaluation"]["max_windows"] = 1
    recipe["variants"] = [{"name": "int8", "weights": {"method": "rtn", "bits": 8}, "exports": ["safetensors"]}]
    recipe.update(changes)
    return recipe


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if the job gets as far as loading the model or its tokenizer."""
    import recipes.pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the job loaded the model before refusing its output path")

    monkeypatch.setattr(recipes.pipeline, "load_causal_lm", refuse)
    monkeypatch.setattr(recipes.pipeline, "load_tokenizer", refuse)


def run_recipe_cli(monkeypatch, capsys, tmp_path, recipe: dict, *args):
    return quantize(monkeypatch, capsys, write_recipe(tmp_path, recipe), *args)


def test_an_output_path_that_is_a_file_is_refused(monkeypatch, capsys, tmp_path, no_model_loads):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, small_recipe(), "--out", taken),
                      "taken", "exists and is a file")
    assert taken.read_text() == "mine"
    under = taken / "out"
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, small_recipe(), "--out", under), "is a file, so nothing")


def test_an_output_folder_that_cannot_be_created_is_refused(monkeypatch, capsys, tmp_path, no_model_loads):
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, small_recipe(), "--out", "/proc/quantbench/out"),
                      "/proc/quantbench")


def test_a_name_too_long_for_the_file_system_is_refused(monkeypatch, capsys, tmp_path, no_model_loads):
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, small_recipe(), "--out", tmp_path / ("x" * 250)),
                      "bytes; this file system takes")


def test_a_gguf_name_made_too_long_by_the_model_folder_is_refused(monkeypatch, capsys, tmp_path, no_model_loads):
    model = tmp_path / ("m" * 230)
    model.symlink_to(TINY)
    recipe = small_recipe(model=str(model))
    recipe["variants"] = [{"name": "q8", "weights": {"method": "gguf", "type": "Q8_0"}, "exports": ["gguf"]}]
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, recipe, "--out", tmp_path / "out"),
                      "-Q8_0.gguf", "this file system takes")
    assert not (tmp_path / "out").exists()


def test_a_nul_byte_in_a_path_is_refused(monkeypatch, capsys, tmp_path):
    path = tmp_path / "r.yaml"
    recipe = write_recipe(tmp_path, small_recipe()).read_text()
    path.write_text(recipe + 'output: "runs/a\\0b"\n')
    assert_user_error(quantize(monkeypatch, capsys, path), "field 'output'", "NUL byte")


def test_a_seed_outside_what_torch_takes_is_refused(monkeypatch, capsys, tmp_path):
    recipe = small_recipe()
    recipe["calibration"]["seed"] = 10**24
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, recipe), "field 'calibration.seed'")


def test_a_window_longer_than_the_models_context_is_refused_at_once(monkeypatch, capsys, tmp_path, no_model_loads):
    recipe = small_recipe()
    recipe["evaluation"]["window"] = 32768
    start = time.perf_counter()
    assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, recipe, "--out", tmp_path / "out"),
                      "field 'evaluation.window': 32768 tokens is longer than the context", "2048 tokens")
    assert time.perf_counter() - start < 10


def test_export_refuses_an_output_that_is_a_folder(monkeypatch, capsys, tmp_path):
    assert_user_error(quantize(monkeypatch, capsys, "export", TINY, "--gguf", "Q8_0", "-o", tmp_path), "is a folder")


# ---------------------------------------------------------------- the folder lock


def test_a_second_job_into_the_same_folder_is_refused(monkeypatch, capsys, tmp_path, no_model_loads):
    from formats.outputs import LOCK, folder_lock

    out = tmp_path / "out"
    with folder_lock(out):
        assert_user_error(run_recipe_cli(monkeypatch, capsys, tmp_path, small_recipe(), "--out", out),
                          "another quantize job is writing this folder", f"pid {os.getpid()}")
        assert (out / LOCK).exists()
    assert not out.exists()  # the lock's folder was made for it, and nothing else was written


def test_a_lock_left_by_a_killed_job_is_taken_over_and_its_partials_swept(tmp_path):
    from formats.outputs import LOCK, folder_lock

    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("a finished file")
    killed = subprocess.run([sys.executable, "-c", f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from formats.outputs import Outputs, folder_lock
out = Path({str(out)!r})
with folder_lock(out):
    Outputs().stage(out / "v" / "model.gguf").write_text("half")
    os.kill(os.getpid(), signal.SIGKILL)
"""])
    assert killed.returncode == -signal.SIGKILL
    pid_file = next((out / "v").glob("model.gguf.*.partial"))
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = out / "v" / f"other.gguf.{alive.pid}.partial"  # another writer, still running: left alone
        live.write_text("in progress")
        with folder_lock(out) as previous:
            assert previous["pid"] != os.getpid() and int(pid_file.name.split(".")[-2]) == previous["pid"]
            assert not pid_file.exists() and live.exists() and (out / "kept.txt").exists()
            assert (out / LOCK).exists()
        assert not (out / LOCK).exists()
    finally:
        alive.kill()


# ---------------------------------------------------------------- kill -9 and stray processes


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def quantize_process(args: list, tag: str) -> subprocess.Popen:
    env = {**os.environ, "QUANTBENCH_TEST_TAG": tag, "COLUMNS": "200"}
    return subprocess.Popen([str(Path(sys.executable).with_name("quantize")), *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def two_cores():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the GGUF encoder forks workers only with two or more cores")


def test_a_killed_export_leaves_no_worker_behind(tmp_path, two_cores):
    tag = uuid.uuid4().hex
    job = quantize_process(["export", TINY, "--gguf", "Q4_K_M", "-o", tmp_path / "m.gguf"], tag)
    try:
        wait_until(lambda: children(job.pid) or job.poll() is not None, 120, "the encoder's worker process")
        workers = children(job.pid)
        assert workers and job.poll() is None, job.stderr.read().decode()
        job.kill()
        job.wait()
        wait_until(lambda: not tagged_processes(tag), 5, f"workers {workers} to end with their parent")
    finally:
        job.kill()
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.Modelfile").exists()


def test_a_job_killed_mid_write_resumes_to_the_same_bytes(tmp_path, two_cores):
    """kill -9 while the GGUF variant is being written: no process stays, the rerun takes the lock
    over, sweeps the partial files, keeps the finished variant, and every file equals those of a
    job that was never interrupted."""
    recipe = small_recipe()
    recipe["variants"].append({"name": "q4_k_m", "weights": {"method": "gguf", "type": "Q4_K_M"}, "exports": ["gguf"]})
    path = write_recipe(tmp_path, recipe)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert subprocess.run([str(Path(sys.executable).with_name("quantize")), str(path), "--out", str(whole)],
                          capture_output=True).returncode == 0
    tag = uuid.uuid4().hex
    job = quantize_process([path, "--out", resumed], tag)
    try:
        wait_until(lambda: list((resumed / "q4_k_m").glob("*.partial")) or job.poll() is not None, 300,
                   "the GGUF variant's partial file")
        assert job.poll() is None, job.stderr.read().decode()
        job.kill()
        job.wait()
    finally:
        job.kill()
    wait_until(lambda: not tagged_processes(tag), 5, "the killed job's workers to end")
    assert list((resumed / "q4_k_m").glob("*.partial")) and (resumed / ".quantbench.lock").exists()
    assert (resumed / "int8" / ".done.json").exists()
    rerun = subprocess.run([str(Path(sys.executable).with_name("quantize")), str(path), "--out", str(resumed)],
                           capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert rerun.returncode == 0, rerun.stderr
    assert "taking over from a job that did not finish" in rerun.stderr and "int8: unchanged" in rerun.stderr
    assert not list(resumed.rglob("*.partial")) and not (resumed / ".quantbench.lock").exists()
    files = sorted(p.relative_to(whole) for p in whole.rglob("*") if p.is_file() and not p.name.startswith((".", "report")))
    assert files == sorted(p.relative_to(resumed) for p in resumed.rglob("*")
                           if p.is_file() and not p.name.startswith((".", "report")))
    for f in files:
        assert (whole / f).read_bytes() == (resumed / f).read_bytes(), f
