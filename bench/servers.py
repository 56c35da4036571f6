"""The HTTP servers the benchmarks drive: ours (`quantize serve`), llama.cpp's `llama-server` and
vLLM's OpenAI server, each started on a free port of 127.0.0.1 and ready once it answers
``/health``; stopped (and waited for) on leaving the block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
ANCHORS = REPO / ".anchors"
LLAMA_SERVER = ANCHORS / "llama-server" / "bin" / "llama-server"
VLLM_PYTHON = ANCHORS / "vllm" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(command: list[str], port: int, env: dict | None = None, timeout: float = 300) -> Iterator[str]:
    """Run a server until the block ends; yields its base URL once ``/health`` answers 200."""
    log = open(os.devnull, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE, env={**os.environ, **(env or {})}, cwd=REPO,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited: {(proc.stderr.read().strip().splitlines() or ['no output'])[-1][:200]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{command[0]} did not answer /health in {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C (SIGINT), as a user stops a server; killed if it has not ended within ``timeout``."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def ours(model: Path, port: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "recipes.cli", "serve", str(model), "--port", str(port), "--served-model-name", "model",
            *options]


def export_f16(model: Path, work: Path) -> Path:
    gguf = work / "model-F16.gguf"
    if not gguf.exists():
        subprocess.run([sys.executable, "-m", "recipes.cli", "export", str(model), "--gguf", "F16", "-o", str(gguf)],
                       check=True, cwd=REPO, capture_output=True)
    return gguf


def llama_server(gguf: Path, port: int, threads: int, slots: int = 8, context_per_slot: int = 2048) -> list[str]:
    # --threads-http: a streaming request holds an HTTP thread until it ends; with the default (one
    # per core) a crowd of waiting streams leaves none for the rest, and the server stalls
    return [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-np", str(slots), "-c", str(slots * context_per_slot), "--no-webui", "-a", "model", "--threads-http", "256"]


def vllm(model: Path, port: int, max_num_seqs: int) -> list[str]:
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "2048", "--dtype", "bfloat16", "--served-model-name", "model",
            "--max-num-seqs", str(max_num_seqs), "--disable-log-stats"]


def vllm_env(threads: int) -> dict:
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
