"""`quantize serve` under load, against llama.cpp's server and vLLM CPU's, in one run, on 127.0.0.1 only.

1. Load: 200 streaming completions at once (prompts cut from the evaluation text at 32, 64, 128 and
   256 tokens in turn, outputs of 16, 64, 128 and 256 tokens in turn, greedy, EOS ignored) against
   our server with 20 running sequences and ``--max-waiting 60``. Every request must complete or be
   refused with 429 within the time limit; the server must still answer /health afterwards, with
   every KV block free. p50/p99 TTFT and TPOT (measured at the client), output tokens/s.
2. Disconnects: 20 clients that leave after two chunks; their blocks must be free within 5 s.
3. The same 200 requests against llama.cpp's ``llama-server`` (8 parallel slots, our F16 GGUF of
   the model) and vLLM CPU's OpenAI server (20 sequences, its own virtualenv), ratios printed.
4. Prefix caching: a shared 1,024-token system prompt before 32 different questions, one at a
   time: mean TTFT with prefix caching against without.

Rows whose anchor is not set up are skipped with the command that sets it up
(``bash bench/anchors/setup.sh llama-server`` / ``vllm``).

    python bench/serve_load.py [--model ../shared/models/ref] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import servers  # noqa: E402
from printout import print_result  # noqa: E402

TEXT = REPO / "recipes" / "bundled" / "eval.txt"
REQUEST_LIMIT_S = 300  # a request still open after this has hung


def workload(tokenizer, requests: int = 200) -> list[tuple[list[int], int]]:
    from runner.bench import Workload, output_lengths, workload_prompts

    w = Workload(requests=requests, concurrency=requests)
    return list(zip(workload_prompts(tokenizer, TEXT, w), output_lengths(w)))


async def stream_one(client, prompt: list[int], max_tokens: int, leave_after: int | None = None) -> dict:
    """One streamed completion: its outcome and client-side times."""
    import httpx

    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    first = last = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return {"outcome": str(reply.status_code)}
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        return {"outcome": "left"}
    except (httpx.HTTPError, OSError) as error:
        return {"outcome": f"error: {type(error).__name__}"}
    if first is None:
        return {"outcome": "empty"}
    return {"outcome": "done", "ttft_s": first - sent, "tpot_s": (last - first) / max(1, max_tokens - 1),
            "tokens": max_tokens}


async def crowd(url: str, items: list[tuple[list[int], int]], leave_after: int | None = None) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(items) + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(REQUEST_LIMIT_S, connect=30), limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.wait_for(stream_one(client, p, n, leave_after), REQUEST_LIMIT_S) for p, n in items]
        results = []
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            results.append(outcome if isinstance(outcome, dict) else {"outcome": f"hung: {type(outcome).__name__}"})
    return results, time.perf_counter() - start


def summary(results: list[dict], seconds: float) -> dict:
    done = [r for r in results if r["outcome"] == "done"]
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    row = {"outcomes": outcomes, "seconds": seconds}
    if done:
        def pct(key: str, q: float) -> float:
            values = sorted(r[key] for r in done)
            return values[min(len(values) - 1, int(q * len(values)))]

        row |= {"ttft_p50_s": pct("ttft_s", 0.5), "ttft_p99_s": pct("ttft_s", 0.99), "tpot_p50_s": pct("tpot_s", 0.5),
                "tpot_p99_s": pct("tpot_s", 0.99), "output_tokens_per_s": sum(r["tokens"] for r in done) / seconds}
    return row


def metrics(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def idle_within(url: str, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        m = metrics(url)
        if m["quantbench_kv_blocks_used"] == 0 and m["quantbench_num_requests_running"] == 0 \
                and m["quantbench_num_requests_waiting"] == 0:
            return True
        time.sleep(0.1)
    return False


def ours_under_load(model: Path, items, threads: int) -> dict:
    import httpx

    port = servers.free_port()
    env = {"OMP_NUM_THREADS": str(threads)}
    with servers.running(servers.ours(model, port, "--max-num-seqs", "20", "--max-waiting", "60", "--dtype", "bf16",
                                      "--kv-memory", "1GiB"), port, env) as url:
        asyncio.run(crowd(url, items[:4]))  # warm-up
        results, seconds = asyncio.run(crowd(url, items))
        row = summary(results, seconds)
        row["idle_after_load"] = idle_within(url, 5)
        left, _ = asyncio.run(crowd(url, [(p, 256) for p, _ in items[:20]], leave_after=2))
        row["disconnects"] = {"left": sum(r["outcome"] == "left" for r in left), "blocks_free_within_5s": idle_within(url, 5)}
        row["health_after"] = httpx.get(url + "/health", timeout=10).status_code
        m = metrics(url)
        row["aborted"] = m.get('quantbench_requests_finished_total{finish_reason="abort"}', 0)
    return row


def anchor(command: list[str], port: int, env: dict, items) -> dict | str:
    try:
        with servers.running(command, port, env, timeout=600) as url:
            asyncio.run(crowd(url, items[:4]))
            results, seconds = asyncio.run(crowd(url, items))
            return summary(results, seconds)
    except RuntimeError as error:
        return f"skipped: {error}"


def prefix_caching(model: Path, tokenizer, threads: int) -> dict:
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    system = ids[:1024]
    questions = [ids[5000 + 40 * i : 5000 + 40 * i + 24] for i in range(32)]
    rows = {}
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        port = servers.free_port()
        with servers.running(servers.ours(model, port, caching, "--dtype", "bf16", "--kv-memory", "1GiB"), port,
                             {"OMP_NUM_THREADS": str(threads)}) as url:
            asyncio.run(crowd(url, [(ids[20000:20100], 4)]))  # warm-up, another text
            ttft = []
            for q in questions:
                results, _ = asyncio.run(crowd(url, [(system + q, 16)]))
                ttft.append(results[0]["ttft_s"])
            rows[caching.removeprefix("--")] = {"mean_ttft_s": statistics.mean(ttft), "first_ttft_s": ttft[0],
                                                 "mean_ttft_after_first_s": statistics.mean(ttft[1:])}
    rows["ratio_with_to_without"] = rows["enable-prefix-caching"]["mean_ttft_s"] / rows["no-enable-prefix-caching"]["mean_ttft_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO.parent / "shared" / "models" / "ref")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    items = workload(tokenizer)
    def phase(name: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)

    phase("quantbench under load")
    rows: dict[str, object] = {"quantbench": ours_under_load(args.model, items, args.threads)}
    phase("llama.cpp server")
    with tempfile.TemporaryDirectory() as work:
        if servers.LLAMA_SERVER.exists():
            gguf = servers.export_f16(args.model, Path(work))
            port = servers.free_port()
            rows["llama.cpp server, 8 slots, F16"] = anchor(servers.llama_server(gguf, port, args.threads), port,
                                                          {}, items)
        else:
            rows["llama.cpp server, 8 slots, F16"] = "skipped: bash bench/anchors/setup.sh llama-server builds it"
    phase("vLLM")
    if servers.VLLM_PYTHON.exists():
        port = servers.free_port()
        rows["vLLM CPU, 20 sequences"] = anchor(servers.vllm(args.model, port, 20), port, servers.vllm_env(args.threads), items)
    else:
        rows["vLLM CPU, 20 sequences"] = "skipped: bash bench/anchors/setup.sh vllm installs it"
    phase("prefix caching")
    rows["prefix caching, 1,024-token shared prompt"] = prefix_caching(args.model, tokenizer, args.threads)
    ours = rows["quantbench"]
    ratios = {}
    for name in ("llama.cpp server, 8 slots, F16", "vLLM CPU, 20 sequences"):
        other = rows[name]
        if isinstance(other, dict) and "output_tokens_per_s" in other:
            ratios[f"tokens/s vs {name}"] = ours["output_tokens_per_s"] / other["output_tokens_per_s"]
            for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
                ratios[f"{key[:-2]} vs {name} (lower is better)"] = ours[key] / other[key]
    ratios["mean TTFT with prefix caching / without (target <= 0.5)"] = rows["prefix caching, 1,024-token shared prompt"]["ratio_with_to_without"]
    checks = {
        "every request completed or got 429": set(ours["outcomes"]) <= {"done", "429"},
        "every block free after the load": ours["idle_after_load"],
        "20 clients that left freed their blocks within 5 s": ours["disconnects"]["left"] == 20
        and ours["disconnects"]["blocks_free_within_5s"],
        "server up afterwards": ours["health_after"] == 200,
    }
    phase("done")
    print_result(rows, ratios, checks, args.json)

if __name__ == "__main__":
    main()
