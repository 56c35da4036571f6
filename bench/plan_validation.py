"""`quantize plan`'s latency model against measured runs on this machine, in one run.

The planner predicts p50 TTFT and TPOT from a roofline of each serving step (runner/plan/). Here
its predictions are set against closed-loop loads (each finished request replaced at once by a
new one from the same user, as ``quantize bench --concurrency`` and a busy service run them) of
the shared ref model in bf16, both engines as OpenAI servers on 127.0.0.1, streamed:

- our engine (``quantize serve``) at 1, 8 and 32 requests in flight;
- vLLM CPU's server (its own virtualenv) at 8 and 32;

each with 32 sequences at most, 2,048 tokens a step, prefix caching off (each row runs the same
prompts three times).

Workload, kept short so the whole bench runs in about ten minutes on two cores: 128-token
prompts cut one after another from the evaluation text, answers of 16 to 48 tokens in a shuffled
order (mean 32), greedy, EOS ignored. Real users' answers vary, so their requests arrive
independently, as the planner models them; with answers of 24, 32 and 40 tokens in turn the
closed loop fell into lock-step, prompts arrived in bursts, and TTFT at 32 in flight came out
0.68-0.72 of the measured (tests/test_plan.py simulates both). The first wave (as many requests
as are in flight, all sent at once) is the ramp-up and is not counted; the steady state after it
is what the planner models. Each row is run three times, each run after its own calibration
(below); the medians of the three p50s, of the three predictions and of the three ratios are
reported.

The planner is given the machine as a ``custom:MEM,BANDWIDTH,TFLOPS`` device, its read bandwidth
and bf16 matmul FLOPs measured in the same run, and each engine's efficiency constants,
calibrated from micro-runs of that server just before each run of its loads, on other prompts
(``calibrate``, medians of seven): a step's fixed overhead and its cost per sequence (TPOT of 1
and of 16 requests decoding together), and the share of the matmul peak a step carrying prompts
reaches, at two sizes (TTFT of one prompt of the loads' length, and of four sent at once, while
16 requests decode), between which the planner interpolates. So the rows test
the serving model (how many prompts share a step, the wait for the step under way, the closed
loop's decode batch) and the roofline's scaling with the batch, not the constants themselves.

It prints, per row, the planner's prediction with the datasheet-style defaults (0.8 of bandwidth,
0.5 of FLOPs, 2 ms a step), with the calibrated constants, the measurement, and their ratios; the
check is the calibrated prediction within 25% of measured.

    python bench/plan_validation.py [--model ../shared/models/ref] [--threads 2] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import servers  # noqa: E402
from fit_speed import read_bandwidth  # noqa: E402
from printout import print_result  # noqa: E402
from serve_load import REQUEST_LIMIT_S, stream_one  # noqa: E402

TEXT = REPO / "recipes" / "bundled" / "eval.txt"
PROMPT = 128
OUTPUTS = tuple(random.Random(0).sample(range(16, 49), 33))  # every length from 16 to 48 once, shuffled: mean 32
CHUNK = 2048  # both engines' max_num_batched_tokens (ours by default, vLLM CPU's server default)
MAX_SEQS = 32
SERVER = ("--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", str(CHUNK), "--dtype", "bf16", "--kv-memory", "1GiB",
          "--no-enable-prefix-caching")
WAVES = {1: 24, 8: 8, 32: 5}  # requests = concurrency x waves; the first wave is the ramp-up
REPEATS = 7  # of each calibration micro-run (the median is taken)
ROWS = (("ours", 1), ("ours", 8), ("ours", 32), ("vllm", 8), ("vllm", 32))
TOLERANCE = 0.25
CALIBRATION_DECODE = (16, 65)  # prompt, answer of the decode micro-runs
CALIBRATION_BATCHES = (4, 16)  # requests decoding together in them: vLLM's one alone runs slower than 16 (docs/plan.md)
BACKGROUND_ANSWER = 400  # tokens the 16 requests decode while the calibration prompts are timed
TOGETHER = 4  # prompts sent at once for the matmul rate's second point


def matmul_flops(threads: int, n: int = 2048) -> float:
    """bf16 FLOP/s of a large square matrix product (the engines run bf16): the best of five, after
    one to warm up. The device's peak, as a datasheet's BF16 TFLOPS is a GPU's."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@dataclass
class Timed:
    """One request's client-side times, in the order it was sent."""

    index: int
    ttft_s: float
    tpot_s: float


def requests(tokenizer, count: int, prompt: int = PROMPT, outputs: tuple[int, ...] = OUTPUTS) -> list[tuple[list[int], int]]:
    from runner.bench import Workload, output_lengths, workload_prompts

    w = Workload(requests=count, concurrency=1, prompt_tokens=(prompt,), output_tokens=outputs)
    return list(zip(workload_prompts(tokenizer, TEXT, w), output_lengths(w)))


async def _http_closed_loop(url: str, items: list[tuple[list[int], int]], concurrency: int) -> list[Timed]:
    import httpx

    queue = list(enumerate(items))[::-1]
    out: list[Timed] = []

    async def user(client) -> None:
        while queue:
            i, (prompt, n) = queue.pop()
            r = await stream_one(client, prompt, n)
            if r["outcome"] != "done":
                raise RuntimeError(f"request {i}: {r['outcome']}")
            out.append(Timed(i, r["ttft_s"], r["tpot_s"]))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(REQUEST_LIMIT_S, connect=30), limits=limits) as client:
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
    return sorted(out, key=lambda t: t.index)


def http_closed_loop(url: str, items: list[tuple[list[int], int]], concurrency: int) -> list[Timed]:
    """The items streamed to an OpenAI server by ``concurrency`` users, each sending its next
    request as soon as its last one ends."""
    return asyncio.run(_http_closed_loop(url, items, concurrency))


async def _while_decoding(url: str, background: list[tuple[list[int], int]], prompts: list[list[int]]) -> list[float]:
    import httpx

    limits = httpx.Limits(max_connections=len(background) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(REQUEST_LIMIT_S, connect=30), limits=limits) as client:
        crowd = [asyncio.create_task(stream_one(client, p, n)) for p, n in background]
        await asyncio.sleep(0.5)  # their prompts are in, they decode
        ttft = []
        for group in prompts:
            answers = await asyncio.gather(*(stream_one(client, prompt, 1) for prompt in group))
            for r in answers:
                if r["outcome"] != "done":
                    raise RuntimeError(f"a calibration prompt: {r['outcome']}")
            if not any(t.done() for t in crowd):
                ttft.append(statistics.median(r["ttft_s"] for r in answers))
        await asyncio.gather(*crowd)
    return ttft


def while_decoding(url: str, background: list[tuple[list[int], int]], prompts: list[list[list[int]]]) -> list[float]:
    """The median TTFT of each group of ``prompts``, a group's prompts sent at once and the groups
    one after another, while the ``background`` requests decode together (groups that came back
    after any of them ended are dropped)."""
    return asyncio.run(_while_decoding(url, background, prompts))


def p50s(timed: list[Timed], skip: int) -> tuple[float, float]:
    """(p50 TTFT, p50 TPOT) of the requests after the first ``skip``."""
    kept = timed[skip:]
    return statistics.median(t.ttft_s for t in kept), statistics.median(t.tpot_s for t in kept)


@dataclass
class Calibration:
    """An engine's efficiency constants, and the micro-runs they came from (seconds, medians)."""

    step_overhead: float  # seconds a step costs beyond the roofline's kernel time
    sequence_overhead: float  # and per sequence in it
    flops_utilisation: float  # share of the measured matmul peak a step carrying one prompt reaches
    flops_curve: tuple  # (tokens in the step, share) with one prompt and with TOGETHER prompts
    decode_tpot_s: dict  # batch -> TPOT of that many short requests decoding together
    prefill_ttft_s: dict  # prompts sent at once -> their TTFT while 16 requests decode

    def device(self, gpu):
        from runner.plan.roofline import Device

        return Device(gpu, flops_utilisation=self.flops_utilisation, step_overhead=self.step_overhead,
                      sequence_overhead=self.sequence_overhead, flops_curve=self.flops_curve)


def calibrate(url: str, work, gpu, tokenizer, skip_ids: int) -> Calibration:
    """Constants from micro-runs on other prompts than the loads', medians of ``REPEATS``:

    - TPOT of 4 and of 16 short requests decoding together (pure decode steps): a step's fixed
      overhead and its cost per sequence, beyond the roofline's kernel time;
    - TTFT of a prompt of the loads' length sent while 16 requests decode: the wait for the
      decode step under way, then the step that carries it with the 16 decode tokens. Less that
      wait and the overheads, its FLOPs give the share of the matmul peak such a step reaches.
      Measured at the loads' length, because a CPU's bf16 matrix products do not run at one rate
      (on this machine a 256-token prompt took 3 to 5 times as long as a 128-token one,
      docs/plan.md), and in a mixed step, because that is the step that carries the loads'
      prompts (on vLLM CPU it costs more than a prompt alone, docs/plan.md);
    - the same with ``TOGETHER`` prompts sent at once, which one step carries together: the share
      at that many tokens. The planner interpolates between the two points in log(tokens)
      (``Device.flops_curve``), since a step carrying several prompts multiplies more rows at
      once and on a CPU reaches a higher rate (vLLM's rows at 8 and 32 in flight were
      over-predicted by 1.5x with the one-prompt share alone, 2026-12-05).

    The single requests go one after another on one connection, after one that is not counted,
    as in the loads (a new connection's setup is not a step's cost)."""
    from runner.plan.roofline import Device, step_seconds

    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][skip_ids:]
    prompt, answer = CALIBRATION_DECODE
    (b1, b2), share = CALIBRATION_BATCHES, 0.5
    together = [(ids[i * 20 : i * 20 + prompt], answer) for i in range(b2)]

    def decode_tpot(batch: int) -> float:
        if batch == 1:
            alone = [(ids[i * 20 : i * 20 + prompt], answer) for i in range(REPEATS + 1)]
            return statistics.median(t.tpot_s for t in http_closed_loop(url, alone, 1)[1:])
        return statistics.median(statistics.median(t.tpot_s for t in http_closed_loop(url, together[:batch], batch))
                                 for _ in range(REPEATS))

    decode = {b: decode_tpot(b) for b in (b1, b2)}
    mixed = {}
    for n in (1, TOGETHER):
        groups = [[ids[1000 + (k * n + j) * PROMPT : 1000 + (k * n + j + 1) * PROMPT] for j in range(n)] for k in range(REPEATS)]
        ttfts = while_decoding(url, [(p, BACKGROUND_ANSWER) for p, _ in together], groups)
        if not ttfts:
            raise RuntimeError(f"the {b2} background requests ended before any calibration prompt came back: lengthen BACKGROUND_ANSWER")
        mixed[n] = statistics.median(ttfts)
    context = prompt + answer / 2
    flops = {n: work.linear_flops(b2 + n * PROMPT) + work.attention_flops(b2, context) + n * work.attention_flops(PROMPT, PROMPT / 2)
             for n in mixed}  # of the step that carries n prompts with the b2 decode tokens
    shares = {n: share for n in mixed}
    overhead = per_sequence = 0.0
    for _ in range(20):  # the decode steps' kernel time depends on the share, which depends on the overhead
        device = Device(gpu, flops_utilisation=shares[1], step_overhead=0.0)
        kernels = {b: step_seconds(work, device, b, context) for b in (b1, b2)}
        per_sequence = max(0.0, ((decode[b2] - kernels[b2]) - (decode[b1] - kernels[b1])) / (b2 - b1))
        overhead = max(0.0, decode[b1] - kernels[b1] - b1 * per_sequence)
        for n, ttft in mixed.items():
            step = ttft - decode[b2]  # the step that carried the prompts, after the one under way
            shares[n] = min(1.0, flops[n] / max(step - overhead - (b2 + n) * per_sequence, 1e-6) / gpu.flops)
    curve = tuple((b2 + n * PROMPT, shares[n]) for n in mixed)
    return Calibration(overhead, per_sequence, shares[1], curve, decode, mixed)


def predict(work, gpu, concurrency: int, calibration: Calibration | None) -> dict[str, float]:
    from runner.plan.roofline import Device
    from runner.plan.serving import Load, colocated

    device = Device(gpu) if calibration is None else calibration.device(gpu)
    p = colocated(work, device, Load(concurrency, PROMPT, round(statistics.mean(OUTPUTS))), CHUNK)
    return {"ttft_p50_s": p.ttft_p50, "tpot_p50_s": p.tpot_p50, "decode_batch": p.decode_batch, "prefill_busy": p.prefill_busy}


def measure(url: str, tokenizer, runs: int, concurrencies: list[int], work, gpu, skip: int) -> list[tuple[Calibration, dict]]:
    """One engine's server at ``url``, ``runs`` times over: its constants from the micro-runs,
    then each load's (p50 TTFT, p50 TPOT). Each run's loads are predicted from the constants
    measured just before them, so a machine shared with other jobs, whose speed drifts over
    minutes, is compared with itself."""
    http_closed_loop(url, requests(tokenizer, 4, 64, (8,)), 4)  # warm-up
    out = []
    for _ in range(runs):
        calibration = calibrate(url, work, gpu, tokenizer, skip)
        out.append((calibration, {c: p50s(http_closed_loop(url, requests(tokenizer, c * WAVES[c]), c), c) for c in concurrencies}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO.parent / "shared" / "models" / "ref")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--vllm-python", type=Path, default=servers.VLLM_PYTHON,
                        help="vLLM CPU's virtualenv python (bash bench/anchors/setup.sh vllm)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from runner.fit.gpus import resolve_gpu
    from runner.fit.memfit import KV_BITS
    from runner.fit.model_shape import load_model_shape
    from runner.plan.roofline import ModelWork
    from runner.plan.variants import model_variant

    def phase(name: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {name} (load average {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    shape = load_model_shape(str(args.model))
    phase("machine")
    bandwidth, flops = read_bandwidth(args.threads), matmul_flops(args.threads)
    gpu = resolve_gpu(f"custom:64,{bandwidth / 1e9:.3f},{flops / 1e12:.5f}")
    work = ModelWork(shape, model_variant(shape).weights_bytes, KV_BITS["fp16"])
    machine = {"read_bandwidth_gbs": bandwidth / 1e9, "bf16_matmul_tflops": flops / 1e12, "device": gpu.name,
               "threads": args.threads, "load_average_1min": os.getloadavg()[0]}
    skip = PROMPT * max(c * WAVES[c] for c in WAVES)  # calibration prompts come from text the loads do not use

    measured: dict[str, list] = {}
    for engine, label in (("ours", "our engine (quantize serve)"), ("vllm", "vLLM CPU")):
        concurrencies = [c for e, c in ROWS if e == engine]
        port = servers.free_port()
        if engine == "ours":
            command, env = servers.ours(args.model, port, *SERVER), {"OMP_NUM_THREADS": str(args.threads)}
        elif args.vllm_python.exists():
            command = servers.vllm(args.model, port, MAX_SEQS) + ["--max-num-batched-tokens", str(CHUNK), "--no-enable-prefix-caching"]
            command[0], env = str(args.vllm_python), servers.vllm_env(args.threads)
        else:
            continue
        phase(label)
        with servers.running(command, port, env, timeout=600) as url:
            measured[engine] = measure(url, tokenizer, args.runs, concurrencies, work, gpu, skip)
    phase("done")
    machine["load_average_1min_end"] = os.getloadavg()[0]

    rows: dict[str, object] = {"machine": machine,
                               **{f"calibration {e}": {f"run {i + 1}": vars(c) for i, (c, _) in enumerate(r)} for e, r in measured.items()}}
    ratios: dict[str, float] = {}
    checks: dict[str, bool] = {}
    for engine, c in ROWS:
        name = f"{'our engine' if engine == 'ours' else 'vLLM CPU'}, {c} in flight"
        if engine not in measured:
            rows[name] = f"skipped: {args.vllm_python} not found (bash bench/anchors/setup.sh vllm installs it)"
            continue
        runs = [{"measured": dict(zip(("ttft_p50_s", "tpot_p50_s"), loads[c])), "predicted": predict(work, gpu, c, calibration),
                 "predicted_one_share": predict(work, gpu, c, replace(calibration, flops_curve=()))}
                for calibration, loads in measured[engine]]
        default = predict(work, gpu, c, None)
        row = {"runs": runs, "predicted_with_defaults": default}
        for key in ("ttft_p50_s", "tpot_p50_s"):
            row[key] = {"measured": statistics.median(r["measured"][key] for r in runs),
                        "predicted": statistics.median(r["predicted"][key] for r in runs),
                        "ratio": statistics.median(r["predicted"][key] / r["measured"][key] for r in runs)}
            label = key.split("_")[0].upper()
            ratios[f"{name}: predicted/measured p50 {label} (median of the runs' ratios)"] = row[key]["ratio"]
            ratios[f"{name}: with default constants, predicted/measured p50 {label}"] = default[key] / row[key]["measured"]
            ratios[f"{name}: with one matmul share (no curve), predicted/measured p50 {label}"] = statistics.median(
                r["predicted_one_share"][key] / r["measured"][key] for r in runs)
            checks[f"{name}: p50 {label} within {TOLERANCE:.0%}"] = abs(row[key]["ratio"] - 1) <= TOLERANCE
        rows[name] = row
    print_result(rows, ratios, checks, args.json)
    if not args.json:
        _table(rows)


def _table(rows: dict) -> None:
    print(f"\n{'row':<26}{'TTFT pred':>11}{'TTFT meas':>11}{'ratio':>7}{'TPOT pred':>11}{'TPOT meas':>11}{'ratio':>7}")
    for name, row in rows.items():
        if not isinstance(row, dict) or "runs" not in row:
            continue
        t, p = row["ttft_p50_s"], row["tpot_p50_s"]
        print(f"{name:<26}{t['predicted'] * 1e3:>9.1f}ms{t['measured'] * 1e3:>9.1f}ms{t['ratio']:>7.2f}"
              f"{p['predicted'] * 1e3:>9.1f}ms{p['measured'] * 1e3:>9.1f}ms{p['ratio']:>7.2f}")
    print("(medians over the runs; each run's ratio is against the constants calibrated just before it)")


if __name__ == "__main__":
    main()
