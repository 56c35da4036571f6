"""A recipe's variants as Ray tasks (``executor: ray`` or ``ray=ADDRESS``; ``--executor`` overrides).

The driver (the ``quantize`` process) scores the original, writes the store of its distributions
and computes the importance matrix once, as a local job does; then each variant to build is one
Ray task running ``pipeline.run_variant``, the local loop's own function, on the job's
``VariantJob``, put in Ray's object store once. A task reads the model, the texts and the
reference store by their paths and writes its files into the output folder, so on a cluster of
several machines those must lie on a filesystem every node mounts at the same path (a local Ray
shares this machine's disk), with quantbench installed on every node.

Each task asks for 1 CPU, the memory ``quantize fit --quantizing`` estimates for its pass
(runner/fit/quantize_memory.py; a scheduling hint, which Ray does not enforce), and 1 GPU where
the cluster has any (a variant runs on CUDA wherever torch sees a GPU, calib/streaming.py). It
computes on as many torch threads as the driver does, whatever Ray gives a worker (one thread a
CPU): GPTQ's float32 sums, and so its files, depend on the thread count, and a variant's files
must be the bytes a local run writes.

A worker that dies is replaced and its task retried by Ray (``_RETRIES`` times): the variant
starts over, the dead writer's partial files swept as the retry stages the same paths
(formats/outputs.py). Each task records its variant when done (recipes/resume.py), so a rerun of
a job whose driver died keeps every variant that finished.

The driver prints a line when a variant's task starts (its worker writes ``.<variant>.worker``
into the output folder, naming its pid and host, and removes it when done) and one when it
finishes; the workers' own output stays in Ray's logs, off the terminal.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from rich.console import Console
from rich.progress import Progress

from core.errors import InputError
from evalsuite.report import VariantRow
from recipes.pipeline import Opened, VariantJob, run_variant
from recipes.schema import Calibration, Recipe, Variant
from runner.fit.gpus import GIB
from runner.fit.model_shape import ModelShape, load_model_shape
from runner.fit.quantize_memory import quantizing_memory

_RETRIES = 2  # a variant's task is redone this many times when its worker dies
_POLL_S = 0.5  # how often the driver looks for tasks that have started
_CANCEL_S = 30  # how long a failing job waits for its cancelled tasks to stop
# the pass of ``quantize fit --quantizing`` whose memory is closest to each fitted method's
_FITTED = {"gptq": "gptq", "awq": "awq", "qat": "gptq"}


@contextmanager
def joined(address: str | None, recipe: Recipe) -> Iterator[dict[str, dict]]:
    """Inside, this process drives Ray: on the cluster at ``address``, else on a Ray it already
    joined, else on a local Ray started for the job (and stopped after it). Yields each variant's
    resource request, checked against the cluster: joined before any work, so a cluster that
    cannot be reached or cannot hold a variant costs no scoring."""
    try:
        import ray
    except ImportError:
        raise InputError("executor ray: ray is not installed (pip install 'quantbench[ray]')") from None

    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise InputError(f"executor ray{'=' + address if address else ''}: cannot start or reach Ray ({e})") from None
    try:
        yield _requests(ray, recipe)
    finally:
        if started:
            ray.shutdown()


def _requests(ray, recipe: Recipe) -> dict[str, dict]:
    """Each variant's Ray resources: 1 CPU, its pass's memory, 1 GPU where the cluster has any."""
    shape = load_model_shape(str(recipe.model))
    largest = max(n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"])
    gpus = 1 if ray.cluster_resources().get("GPU", 0) else 0
    requests = {}
    for v in recipe.variants:
        memory = _memory(shape, v, recipe.calibration)
        if memory > largest:
            raise InputError(f"variant '{v.name}': quantizing it takes about {memory / GIB:.1f} GiB "
                             f"(quantize fit --quantizing), more than any Ray node has ({largest / GIB:.1f} GiB)")
        requests[v.name] = {"num_cpus": 1, "memory": memory, "num_gpus": gpus}
    return requests


def run_on_ray(job: VariantJob, variants: list[Variant], keys: dict[str, str], requests: dict[str, dict],
               console: Console, progress: Progress) -> dict[str, VariantRow]:
    """Each variant's row, built by a Ray task (with its ``requests``) on the Ray this process has ``joined``."""
    import ray

    # paths as every worker reads them, whatever its working directory
    job = replace(job, recipe=job.recipe.based_at(Path.cwd()), out_dir=job.out_dir.resolve())
    task = ray.remote(max_retries=_RETRIES)(_variant_task)
    shared = ray.put(job)
    pending = {}
    for v in variants:
        _marker(job, v).unlink(missing_ok=True)
        pending[task.options(**requests[v.name]).remote(shared, v, keys[v.name])] = v
    bar = progress.add_task(f"variants on Ray ({len(variants)} tasks)", total=len(variants))
    workers: dict[str, int] = {}
    rows = {}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for v in pending.values():
                _announce(console, job, v, workers)
            for ref in ready:
                v = pending.pop(ref)
                rows[v.name] = _result(ray, ref)
                console.print(f"{v.name}: finished on Ray ({rows[v.name].seconds:.1f} s)", markup=False, highlight=False)
                progress.advance(bar)
    except BaseException:
        # force: the task's worker is killed, not interrupted. A KeyboardInterrupt that lands inside
        # an import leaves the worker's modules half initialized, and Ray would hand that worker
        # the rerun's next task (seen in CI: "partially initialized module 'accelerate.big_modeling'")
        for ref in pending:
            ray.cancel(ref, force=True)
        if pending:  # the job fails once its other tasks have stopped: none writes into a rerun's folder
            ray.wait(list(pending), num_returns=len(pending), timeout=_CANCEL_S)
        raise
    finally:
        progress.remove_task(bar)
        for v in variants:
            _marker(job, v).unlink(missing_ok=True)
    return rows


def _variant_task(job: VariantJob, variant: Variant, key: str) -> VariantRow:
    """One variant on a Ray worker: the model, tokenizer and tasks opened here, no progress shown."""
    host = socket.gethostname()
    if not job.out_dir.is_dir():
        raise InputError(f"{job.out_dir}: not found on Ray node {host}; the nodes of a cluster need the output "
                         "folder (and the model and texts) on a filesystem they all mount at the same path")
    marker = _marker(job, variant)
    marker.write_text(json.dumps({"pid": os.getpid(), "host": host}))
    torch.set_num_threads(job.threads)
    try:
        return run_variant(job, variant, key, Opened.of(job.recipe), Progress(disable=True))
    finally:
        marker.unlink(missing_ok=True)


def _marker(job: VariantJob, variant: Variant) -> Path:
    return job.out_dir / f".{variant.name}.worker"


def _announce(console: Console, job: VariantJob, variant: Variant, workers: dict[str, int]) -> None:
    """Print that the variant's task started, once per worker that takes it up."""
    try:
        worker = json.loads(_marker(job, variant).read_text())
    except (OSError, ValueError):
        return  # not started yet (or the marker is being written)
    if workers.get(variant.name) == worker["pid"]:
        return
    again = " again: its previous worker died" if variant.name in workers else ""
    workers[variant.name] = worker["pid"]
    console.print(f"{variant.name}: started on Ray (pid {worker['pid']} on {worker['host']}){again}",
                  markup=False, highlight=False)


def _result(ray, ref) -> VariantRow:
    """The task's row; a user error raised in the task is raised here as the one-line error it is."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, InputError):
            raise e.cause from None
        raise


def _memory(shape: ModelShape, variant: Variant, calibration: Calibration | None) -> int:
    """Bytes to reserve for the variant's task: ``quantize fit --quantizing``'s estimate of its pass
    (RTN's for passes that fit nothing, GPTQ's layer-wise pass for calibrated RTN and QAT)."""
    w = variant.weights
    calibrated = getattr(w, "outliers", None) is not None or variant.activations is not None
    method = _FITTED.get(w.method, "gptq" if calibrated else "rtn")
    sized = {} if calibration is None else {"windows": calibration.max_windows, "window": calibration.window}
    return quantizing_memory(shape, method, **sized).peak_bytes
