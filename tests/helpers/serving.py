"""`quantize serve` in a process of its own, for tests that measure it from outside (its RSS, its
answers while other clients misbehave): started on a free port of 127.0.0.1, ready once /health
answers, stopped with Ctrl-C (SIGINT) and waited for (bench/servers.py's stop). Unlike
bench/servers.py's `running`, it gives the test the server's process id."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from bench.servers import free_port, stop

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def serving(model: Path, *options: str, timeout: float = 120) -> Iterator[tuple[str, int]]:
    """``(base URL, pid)`` of `quantize serve MODEL OPTIONS` while the block runs."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from recipes.cli import main; main()", "serve", str(model),
                             "--port", str(port), *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.time() < deadline, "the server did not answer /health"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url, proc.pid
    finally:
        stop(proc, 30)


def rss_mib(pid: int) -> float:
    """A process's resident memory now, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
