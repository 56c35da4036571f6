"""Worker processes that encode the row blocks of a large tensor in parallel.

Rows are encoded independently by every ggml type, so the bytes do not depend on how the rows are
split; the encoders are pure numpy and make hundreds of small calls per chunk, which is why they
run in forked processes rather than threads where the platform allows.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np

# Below this many super-blocks per worker, the cost of shipping the rows to a worker process
# outweighs the gain.
_MIN_VALUES_PER_WORKER = 128 * 256


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def by_row_blocks(
    encoder: Callable[[np.ndarray, np.ndarray | None], np.ndarray], rows: np.ndarray, imatrix: np.ndarray | None
) -> np.ndarray:
    """Run an encoder on row blocks in parallel, this process taking the first block.

    Rows are encoded independently, so the bytes do not depend on the split.
    """
    parts = min(_cores(), max(1, rows.size // _MIN_VALUES_PER_WORKER))
    if parts == 1:
        return encoder(rows, imatrix)
    bounds = np.linspace(0, rows.shape[0], parts + 1).astype(int)
    with _POOL_LOCK:  # tensors are encoded in several threads at once ahead of a GPU build's writers: one pool
        pool = _worker_pool()
    futures = [pool.submit(encoder, rows[bounds[i] : bounds[i + 1]], imatrix) for i in range(1, parts)]
    head = encoder(rows[: bounds[1]], imatrix)
    return np.concatenate([head, *(f.result() for f in futures)])


_POOL_LOCK = threading.Lock()


@functools.cache
def _worker_pool() -> Executor:
    """Workers for the encoders, kept for the life of the process.

    The encoders make hundreds of small numpy calls per chunk, and threads lose much of their time
    handing the GIL over between those calls: on 2 cores, Q4_K runs 1.5x as fast as on one with
    threads and 1.6-1.7x with processes, and the ref model converts to Q4_K_M in 3.4 s instead of
    4.25 s. Forked processes start in milliseconds with the encoders already imported; they run
    numpy only, never torch, so the parent's thread pools do not matter to them. Where fork is not
    the platform's safe choice (macOS, Windows) threads do the work.
    """
    workers = max(1, _cores() - 1)
    if sys.platform.startswith("linux"):
        fork = multiprocessing.get_context("fork")
        return ProcessPoolExecutor(workers, mp_context=fork, initializer=_start_worker, initargs=(os.getpid(),))
    return ThreadPoolExecutor(workers)


def _start_worker(parent: int) -> None:
    """Set up a forked worker.

    It gets its own stdout/stderr: the inherited stream objects may carry a lock a parent thread (a
    progress bar) held at the fork, and a worker flushes its streams on exit. And it dies with its
    parent: a worker waits on a pipe whose other end it holds itself (fork copies it), so when the
    parent is killed nothing would ever wake it. A watchdog thread checks twice a second whether
    the worker has been handed to another parent (the parent is gone) and ends it then. (Linux's
    parent-death signal would follow the thread that forked, not the process, and the pool may be
    started by a short-lived thread.)
    """
    sys.stdout = sys.stderr = open(os.devnull, "w")
    threading.Thread(target=_exit_with, args=(parent,), daemon=True, name="exit-with-parent").start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
