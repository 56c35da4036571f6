"""`quantize serve` under load, against llama.cpp's server and vLLM CPU's, in one run, on 127.0.0.1 only.

1. Throughput, the same work on every server: 200 streaming completions at once (prompts cut
   from the evaluation text at 32, 64, 128 and 256 tokens in turn, outputs of 16, 64, 128 and 256
   tokens in turn, greedy, EOS ignored) against our server (20 running sequences, the default
   ``--max-waiting``, which queues all of them), vLLM CPU's OpenAI server (20 sequences, its own
   virtualenv; it queues without a limit). Both run side by side; each first runs the whole load
   once, uncounted (a server's first round ran up to 25% slower than its later ones), then they
   take turns, ``--runs`` rounds (4), in an order reversed each round: the machine drifts from
   minute to minute (two identical servers differed by up to 1.5x in a round), so the ratio is
   the median of the rounds' ratios. p50/p99 TTFT and TPOT (at the client), output tokens/s, and
   whether every request completed. Then once, llama.cpp's ``llama-server`` (8 parallel slots,
   our F16 GGUF of the model), which stalls above about 150 concurrent streams on this load
   (README).
2. Overload, on our server with ``--max-waiting 60``: the same 200 at once. Every request must
   complete or be refused with 429 within the time limit, 429s only past the 20 running and 60
   waiting; the server must still answer /health afterwards, with every KV block free.
3. Disconnects: 20 clients that leave after two chunks; their blocks must be free within 5 s.
4. Prefix caching: a shared 1,024-token system prompt before 32 different questions, one at a
   time: mean TTFT with prefix caching against without.

Rows whose anchor is not set up are skipped with the command that sets it up
(``bash bench/anchors/setup.sh llama-server`` / ``vllm``).

    python bench/serve_load.py [--model ../shared/models/ref] [--threads 2] [--runs 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import servers  # noqa: E402
from printout import print_result  # noqa: E402

TEXT = REPO / "recipes" / "bundled" / "eval.txt"
REQUEST_LIMIT_S = 300  # a request still open after this has hung
VLLM, LLAMA = "vLLM CPU, 20 sequences", "llama.cpp server, 8 slots, F16"


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


OURS = ("--max-num-seqs", "20", "--dtype", "bf16", "--kv-memory", "1GiB")
OVERLOAD_WAITING = 60


def throughput(commands: dict[str, tuple[list[str], int, dict]], items, runs: int) -> dict[str, dict]:
    """Every server started at once and warmed by the whole load, then ``runs`` rounds in which
    each runs it in turn; per server, each round's summary and the medians over rounds."""
    rounds: dict[str, list[dict]] = {name: [] for name in commands}
    with ExitStack() as stack:
        urls = {}
        for name, (command, port, env) in commands.items():
            try:
                urls[name] = stack.enter_context(servers.running(command, port, env, timeout=600))
            except RuntimeError as error:
                rounds[name] = f"skipped: {error}"  # type: ignore[assignment]
        for url in urls.values():  # a whole load first, not counted
            asyncio.run(crowd(url, items))
        for run in range(runs):  # in turn, the order reversed each round: a drifting machine favours neither
            for name, url in (list(urls.items()) if run % 2 == 0 else list(urls.items())[::-1]):
                results, seconds = asyncio.run(crowd(url, items))
                rounds[name].append(summary(results, seconds))
    return {name: r if isinstance(r, str) else _medians(r) for name, r in rounds.items()}


def _medians(rounds: list[dict]) -> dict:
    keys = [k for k in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s") if k in rounds[0]]
    return {k: statistics.median(r[k] for r in rounds) for k in keys} | {"rounds": rounds}


def ours_overloaded(model: Path, items, threads: int) -> dict:
    import httpx

    port = servers.free_port()
    env = {"OMP_NUM_THREADS": str(threads)}
    with servers.running(servers.ours(model, port, *OURS, "--max-waiting", str(OVERLOAD_WAITING)), port, env) as url:
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
    parser.add_argument("--runs", type=int, default=4, help="rounds of the throughput load on each server")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    items = workload(tokenizer)
    def phase(name: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)

    rows: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as work:
        commands = {"quantbench": (servers.ours(args.model, port := servers.free_port(), *OURS), port,
                                   {"OMP_NUM_THREADS": str(args.threads)})}
        if servers.VLLM_PYTHON.exists():
            commands[VLLM] = (servers.vllm(args.model, port := servers.free_port(), 20), port, servers.vllm_env(args.threads))
        else:
            rows[VLLM] = "skipped: bash bench/anchors/setup.sh vllm installs it"
        phase(f"throughput: {', '.join(commands)}, {args.runs} rounds")
        rows |= throughput(commands, items, args.runs)
        phase("llama.cpp server")
        if servers.LLAMA_SERVER.exists():
            gguf = servers.export_f16(args.model, Path(work))
            rows |= throughput({LLAMA: (servers.llama_server(gguf, port := servers.free_port(), args.threads), port, {})},
                               items, 1)
        else:
            rows[LLAMA] = "skipped: bash bench/anchors/setup.sh llama-server builds it"
    phase("quantbench overloaded")
    overloaded = rows["quantbench overloaded (--max-waiting 60)"] = ours_overloaded(args.model, items, args.threads)
    phase("prefix caching")
    rows["prefix caching, 1,024-token shared prompt"] = prefix_caching(args.model, tokenizer, args.threads)
    ours = rows["quantbench"]
    ratios = {}
    for name in (VLLM, LLAMA):
        other = rows.get(name)
        if isinstance(other, dict) and "output_tokens_per_s" in other:
            paired = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(ours["rounds"], other["rounds"])]
            ratios[f"tokens/s vs {name} (median of the rounds' ratios)"] = statistics.median(paired)
            for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
                ratios[f"{key[:-2]} vs {name} (lower is better)"] = ours[key] / other[key]
    ratios["mean TTFT with prefix caching / without (target <= 0.5)"] = rows["prefix caching, 1,024-token shared prompt"]["ratio_with_to_without"]
    refused = overloaded["outcomes"].get("429", 0)
    checks = {
        "ours and vLLM completed every request, every round": all(
            r["outcomes"] == {"done": len(items)} for name in ("quantbench", VLLM) if isinstance(rows.get(name), dict)
            for r in rows[name]["rounds"]),
        "overloaded: every request completed or got 429": set(overloaded["outcomes"]) <= {"done", "429"},
        "overloaded: 429s only past 20 running and 60 waiting": len(items) - refused >= 20 + OVERLOAD_WAITING,
        "every block free after the load": overloaded["idle_after_load"],
        "20 clients that left freed their blocks within 5 s": overloaded["disconnects"]["left"] == 20
        and overloaded["disconnects"]["blocks_free_within_5s"],
        "server up afterwards": overloaded["health_after"] == 200,
    }
    phase("done")
    print_result(rows, ratios, checks, args.json)

if __name__ == "__main__":
    main()
