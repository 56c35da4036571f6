"""The engine's speed against the engines people would otherwise use, on one fixed workload, in one run.

Workload: 32 requests; prompts cut one after another from the evaluation text at 32, 64, 128 and
256 tokens in turn; outputs of 16, 64, 128 and 256 tokens in turn; greedy, EOS ignored; the shared
ref model in bf16; every side on the same ``--threads`` cores. Ours runs them all, at most 16 at a
time (the row the targets are for: more at a time trades per-token latency for throughput) and
all 32 at once. Baselines, each measured here:

- transformers ``generate`` in static batches of 8 with left padding (each batch runs to its
  longest output; only the requested tokens count): output tokens/s, mean TTFT and TPOT, with
  every request arriving at the start;
- transformers' own continuous batching (``init_continuous_batching``), where it runs;
- one sequence decoding, bf16 against our int8 and int4 variants (compressed-tensors exports run
  on torch's low-bit kernels), each against ``quantize fit``'s decode ceiling for this machine's
  read bandwidth measured in the same run;
- llama.cpp's ``llama-server`` with 8 parallel slots on our F16 GGUF export
  (``bash bench/anchors/setup.sh llama-server`` builds it, about 10 minutes);
- vLLM's CPU build offline (``bash bench/anchors/setup.sh vllm``, about 75 s).

A row whose anchor is not set up is skipped with the command that sets it up.

    python bench/runner_speed.py [--threads 2] [--model ../shared/models/ref] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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


def workload(llm) -> tuple[list[list[int]], list[int]]:
    from runner.bench import Workload, workload_prompts

    w = Workload(requests=32, concurrency=32)
    return workload_prompts(llm.tokenizer, TEXT, w), [w.output_tokens[i % 4] for i in range(w.requests)]


def ours(model: Path, max_num_seqs: int) -> dict:
    from runner.bench import Workload, run_bench
    from runner.engine.llm import LLM

    llm = LLM(model, dtype="bf16", kv_memory=1 << 30, max_num_seqs=max_num_seqs)
    run_bench(llm, TEXT, Workload(requests=4, concurrency=4, output_tokens=(8,)))  # warm-up
    r = run_bench(llm, TEXT, Workload(requests=32, concurrency=32))
    return {"tokens_per_s": r.output_tokens_per_s, "ttft_s": r.ttft_s.mean, "tpot_s": r.tpot_s.mean, "seconds": r.seconds}


def transformers_static(model: Path, prompts: list[list[int]], outputs: list[int], batch: int = 8) -> dict:
    """``generate`` on batches of 8 in arrival order, left-padded; times by a streamer's steps."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()

    class Steps:
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    ttft, tpot, start = [], [], time.perf_counter()
    for b in range(0, len(prompts), batch):
        ps, outs = prompts[b : b + batch], outputs[b : b + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        steps = Steps()
        with torch.no_grad():
            m.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs), do_sample=False,
                       pad_token_id=0, streamer=steps)
        tokens = steps.times[1:]  # the first put is the prompt
        for n in outs:
            ttft.append(tokens[0] - start)
            tpot.append((tokens[n - 1] - tokens[0]) / (n - 1))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(outputs) / seconds, "ttft_s": sum(ttft) / len(ttft), "tpot_s": sum(tpot) / len(tpot),
            "seconds": seconds}


def transformers_continuous(model: Path, prompts: list[list[int]], outputs: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    manager = m.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=256, do_sample=False,
                                                                            eos_token_id=-1, pad_token_id=0))
    manager.start()
    try:
        start = time.perf_counter()
        for p, n in zip(prompts, outputs):
            manager.add_request(p, max_new_tokens=n)
        done = tokens = 0
        while done < len(prompts):
            result = manager.get_result(timeout=60)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds}


def one_sequence(model: Path, variants: Path, threads: int) -> dict:
    """TPOT of one sequence, 64-token prompt then 128 tokens, for bf16, int8 and int4, and fit's ceiling."""
    from fit_speed import read_bandwidth

    from formats.hf import HFCheckpoint
    from recipes.schema import Variant
    from recipes.variants import build_variant
    from runner.engine.llm import LLM
    from runner.engine.sampling import SamplingParams
    from runner.fit.gpus import resolve_gpu
    from runner.fit.memfit import ENGINES, FitQuery, fit
    from runner.fit.model_shape import load_model_shape

    ckpt = HFCheckpoint.open(model)
    specs = {"int8": ({"method": "rtn", "bits": 8}, "int8"),
             "int4": ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 128}, "int4")}
    for name, (weights, _) in specs.items():
        build_variant(ckpt, Variant.model_validate({"name": name, "weights": weights, "exports": ["compressed-tensors"]}),
                      variants)
    bandwidth = read_bandwidth(threads)
    shape = load_model_shape(str(model))
    device = resolve_gpu(f"custom:64,{bandwidth / 1e9:.3f}")
    rows = {}
    for name, path, fmt in (("bf16", model, "bf16"), ("int8", variants / "int8", "int8"), ("int4", variants / "int4", "int4")):
        llm = LLM(path, dtype="bf16", kv_memory=64 * 2**20)
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        prompt = list(range(100, 164))
        llm.generate([prompt], params)
        best = min(llm.generate([prompt], params)[0].metrics.tpot_s for _ in range(3))
        ceiling = fit(shape, FitQuery(fmt, 128, "bf16", 192, 1, device, 1, ENGINES["vllm"]), smallest=False).decode_tokens_per_s_max
        rows[name] = {"tokens_per_s": 1 / best, "ceiling_tokens_per_s": ceiling, "of_ceiling": 1 / best / ceiling}
    rows["bandwidth_gbs"] = bandwidth / 1e9
    return rows


def llama_server(model: Path, prompts: list[list[int]], outputs: list[int], threads: int, work: Path) -> dict | str:
    if not servers.LLAMA_SERVER.exists():
        return "skipped: bash bench/anchors/setup.sh llama-server builds it (about 10 minutes)"
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    port = servers.free_port()
    try:
        with servers.running(servers.llama_server(servers.export_f16(model, work), port, threads, 8, 1024), port) as url:
            def complete(item):
                prompt, n = item
                body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False})
                request = urllib.request.Request(url + "/completion", body.encode(), {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=600) as r:
                    return json.loads(r.read())["tokens_predicted"]

            start = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                tokens = sum(pool.map(complete, zip(prompts, outputs)))
            seconds = time.perf_counter() - start
    except RuntimeError as error:
        return f"skipped: {error}"
    return {"tokens_per_s": tokens / seconds, "seconds": seconds}


VLLM = r"""
import json, sys, time


def main():  # vLLM starts its engine core in a spawned process, which imports this file again
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, outputs = json.loads(open(sys.argv[2]).read())
    llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=1024, seed=0)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params[0])  # warm-up
    for _ in range(int(sys.argv[3])):
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        seconds = time.perf_counter() - start
        print("RESULT " + json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
"""


def vllm(model: Path, prompts: list[list[int]], outputs: list[int], threads: int, work: Path, repeats: int = 1) -> dict | str:
    """vLLM's CPU build offline on the workload, started once and run ``repeats`` times: the median
    run's tokens/s, and every run's."""
    python = servers.VLLM_PYTHON
    if not python.exists():
        return "skipped: bash bench/anchors/setup.sh vllm installs it (about 75 s)"
    data, script = work / "workload.json", work / "vllm_offline.py"
    data.write_text(json.dumps([prompts, outputs]))
    script.write_text(VLLM)
    env = {**os.environ, **servers.vllm_env(threads)}  # a fixed 2 GiB KV space: its default takes a share of free memory
    proc = subprocess.run([str(python), str(script), str(model), str(data), str(repeats)], capture_output=True, text=True,
                          env=env, timeout=1800)
    results = [json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not results:
        causes = [l for l in proc.stderr.splitlines() if "Error" in l and "Engine core initialization failed" not in l]
        return f"skipped: vLLM failed ({(causes or proc.stderr.strip().splitlines() or ['no output'])[-1].strip()[:300]})"
    runs = [r["tokens"] / r["seconds"] for r in results]
    return {"tokens_per_s": statistics.median(runs), "runs": runs, "seconds": statistics.median(r["seconds"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO.parent / "shared" / "models" / "ref")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from runner.engine.llm import LLM

    prompts, outputs = workload(LLM(args.model, dtype="bf16", kv_memory=64 * 2**20))
    rows: dict[str, object] = {"quantbench": ours(args.model, 16), "quantbench, all 32 at once": ours(args.model, 32),
                               "transformers static batches of 8": transformers_static(args.model, prompts, outputs)}
    try:
        rows["transformers continuous batching"] = transformers_continuous(args.model, prompts, outputs)
    except Exception as e:  # an anchor that does not run here is reported, not fatal
        rows["transformers continuous batching"] = f"skipped: {type(e).__name__}: {str(e)[:160]}"
    with tempfile.TemporaryDirectory() as work:
        rows["one sequence"] = one_sequence(args.model, Path(work) / "variants", args.threads)
        rows["llama.cpp server, 8 slots, F16"] = llama_server(args.model, prompts, outputs, args.threads, Path(work))
        rows["vLLM CPU"] = vllm(args.model, prompts, outputs, args.threads, Path(work))
    ours_row, static = rows["quantbench"], rows["transformers static batches of 8"]
    ratios = {"tokens/s vs transformers static (target >= 3)": ours_row["tokens_per_s"] / static["tokens_per_s"],
              "tokens/s, all 32 at once, vs transformers static": rows["quantbench, all 32 at once"]["tokens_per_s"] / static["tokens_per_s"],
              "mean TTFT vs transformers static (target < 1)": ours_row["ttft_s"] / static["ttft_s"],
              "mean TPOT vs transformers static (target < 1)": ours_row["tpot_s"] / static["tpot_s"]}
    best = max(ours_row["tokens_per_s"], rows["quantbench, all 32 at once"]["tokens_per_s"])
    for name, goal in (("transformers continuous batching", ">= 1"), ("llama.cpp server, 8 slots, F16", "goal: match"),
                       ("vLLM CPU", "goal: beat")):
        if isinstance(rows[name], dict):
            ratios[f"tokens/s (best of ours) vs {name} ({goal})"] = best / rows[name]["tokens_per_s"]
    one = rows["one sequence"]
    for q in ("int8", "int4"):
        ratios[f"one sequence {q} vs bf16 (target > 1)"] = one[q]["tokens_per_s"] / one["bf16"]["tokens_per_s"]
    print_result(rows, ratios, as_json=args.json)


if __name__ == "__main__":
    main()
