"""Peak memory of a whole recipe job on a model of Llama-3-8B's shape: GPTQ W4 g128, Q4_K_M with
an importance matrix, and the evaluation of the original and both variants.

Makes a synthetic checkpoint of Llama-3-8B's shape (hidden 4096, FFN 14336, 32 query / 8 key-value
heads, vocab 128256, untied head; random bf16 weights, the bundled tokenizer) cut to N decoder
layers, and runs `run_recipe` on it in a child process that samples its own RSS and its worker
processes' every 50 ms, attributing each sample to the job's current stage (the progress bar's
newest task; between tasks, "after" the one that ended last). It samples proportional set sizes
(PSS), which count a page that a forked encoder worker shares with the job once, not twice as
summed RSS would; they include the pages of the checkpoint's files that reading a tensor maps in,
which the kernel may drop at will, so the anonymous share (what the job itself allocated) is
printed beside. The job's own peak RSS (ru_maxrss) is printed too. The job streams every model
layer by layer (calibration, quantization, evaluation), so a stage's peak is one layer's working
set, the windows' hidden states, the embedding or head, and a chunk of logits, whatever N is: the
job runs at 1 and at N layers, and each stage's peak is extrapolated linearly to 32 layers from the
two (a growth per layer, if any, is printed). Target: below 8 GiB for the whole recipe at 32
layers. Baseline for scale: the 8B model in float32, what loading it whole for evaluation takes.

``--shape 1b`` runs a synthetic model of Llama-3.2-1B's shape (hidden 2048, FFN 8192, 16 layers,
vocab 128256, tied) whole, end to end, with its peak RSS: no extrapolation.

    python bench/recipe_memory.py [--layers N] [--shape 8b|1b] [--windows 32] [--window 128] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf_memory import make_checkpoint  # noqa: E402  (a sibling script)

LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16",
}
SHAPES = {
    "8b": LLAMA3,
    "1b": LLAMA3 | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
                    "tie_word_embeddings": True},
}
LIMIT_MIB = 8192
CALIBRATION_WINDOWS, CALIBRATION_WINDOW = 16, 128

# Runs the recipe at argv[1] into argv[2], sampling PSS (own + live children) by stage; prints one
# JSON line: {stage: peak MiB}, the job's own peak RSS (ru_maxrss) and the seconds.
_RUN_AND_SAMPLE = """
import json, os, resource, sys, threading, time
from pathlib import Path
from rich.console import Console
from rich.progress import Progress
import recipes.pipeline as pipeline
from recipes.schema import load_recipe

stages, current, live = {}, ["start"], []

class Staged(Progress):
    def add_task(self, description, *args, **kwargs):
        task = super().add_task(description, *args, **kwargs)
        live.append((task, description))
        current[0] = description
        return task
    def remove_task(self, task):
        done = next(d for t, d in live if t == task)
        super().remove_task(task)
        live[:] = [(t, d) for t, d in live if t != task]
        current[0] = live[-1][1] if live else f"after {done}"

def pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            found = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith("Pss")}
        return found.get("Pss", 0), found.get("Pss_Anon", 0)
    except OSError:
        return 0, 0

def children():
    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            pids += open(f"/proc/self/task/{tid}/children").read().split()
        except OSError:
            pass
    return pids

def sample():
    while True:
        kib = [sum(v) for v in zip(pss_kib("self"), *(pss_kib(p) for p in children()))]
        stage = current[0]
        stages[stage] = [max(a, b) for a, b in zip(stages.get(stage, (0, 0)), kib)]
        time.sleep(0.05)

threading.Thread(target=sample, daemon=True).start()
pipeline.progress_bar = lambda console: Staged(console=console, disable=True)
start = time.perf_counter()
pipeline.run_recipe(load_recipe(Path(sys.argv[1])), Path(sys.argv[2]), Console(quiet=True))
seconds = time.perf_counter() - start
time.sleep(0.05)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"stages": {s: [k / 1024 for k in kib] for s, kib in stages.items()}, "peak_mib": peak / 1024, "seconds": seconds}))
"""


def run_job(work: Path, config: dict, layers: int, windows: int, window: int, keep: Path | None) -> dict:
    """The recipe on the synthetic model cut to ``layers`` decoder layers: stage peaks in MiB."""
    import yaml

    cut = config | {"num_hidden_layers": layers}
    model = (keep or work) / f"synthetic-{layers}"
    if not (model / "config.json").is_file() or json.loads((model / "config.json").read_text()) != cut:
        shutil.rmtree(model, ignore_errors=True)
        start = time.perf_counter()
        params = make_checkpoint(model, cut)
        print(f"synthetic checkpoint, {layers} layers: {params / 1e9:.2f}B params in {time.perf_counter() - start:.0f} s",
              flush=True)
    bundled = REPO / "recipes" / "bundled"
    recipe = {
        "model": str(model),
        "evaluation": {"text": str(bundled / "eval.txt"), "window": window, "max_windows": windows},
        "calibration": {"text": str(bundled / "calib.txt"), "window": CALIBRATION_WINDOW,
                        "max_windows": CALIBRATION_WINDOWS},
        "variants": [
            {"name": "gptq-w4g128", "weights": {"method": "gptq", "bits": 4, "group_size": 128}, "exports": ["gptq"]},
            {"name": "q4_k_m-imatrix", "weights": {"method": "gguf", "type": "Q4_K_M", "imatrix": True},
             "exports": ["gguf"]},
        ],
    }
    path = work / f"recipe-{layers}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = work / f"out-{layers}"
    done = subprocess.run([sys.executable, "-c", _RUN_AND_SAMPLE, str(path), str(out)], check=True, cwd=REPO,
                          stdout=subprocess.PIPE, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    print(f"{layers} layers: job {result['seconds']:.0f} s, its own peak RSS {result['peak_mib']:.0f} MiB", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, help="decoder layers of the cut model (8b: default 2; 1b: all 16)")
    parser.add_argument("--windows", type=int, default=32, help="evaluation windows")
    parser.add_argument("--window", type=int, default=128, help="tokens per evaluation window")
    parser.add_argument("--keep", type=Path, help="keep the synthetic checkpoints here (reused when present)")
    args = parser.parse_args()
    config = SHAPES[args.shape]
    total = config["num_hidden_layers"]
    layers = args.layers or (2 if args.shape == "8b" else total)
    if not 1 <= layers <= total:
        sys.exit(f"--layers: between 1 and {total}")

    work = Path(tempfile.mkdtemp(prefix="recipe_memory_"))
    try:
        runs = {n: run_job(work, config, n, args.windows, args.window, args.keep) for n in sorted({1, layers})}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    params = total * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + v * h * (1 if config["tie_word_embeddings"] else 2) + h
    whole_mib = params * 4 / 2**20
    print(f"\nshape {args.shape}: {params / 1e9:.2f}B params at {total} layers; baseline, the whole model in float32 "
          f"(what loading it for evaluation took): {whole_mib:.0f} MiB")
    print(f"recipe: GPTQ W4 g128, Q4_K_M with imatrix; calibration {CALIBRATION_WINDOWS}x{CALIBRATION_WINDOW} tokens, "
          f"evaluation {args.windows}x{args.window} tokens")
    measured = runs[layers]
    one = runs[1]
    extrapolate = layers > 1 and layers < total
    print(f"\n{'stage (peak PSS, MiB)':40s} {'measured':>10s} {'anonymous':>10s}" + (f" {'at 1 layer':>11s} {'per layer':>10s} {f'at {total}':>10s}" if extrapolate else ""))
    whole = 0.0
    for stage, (mib, anon) in sorted(measured["stages"].items(), key=lambda kv: -kv[1][0]):
        line = f"{stage:40s} {mib:10.0f} {anon:10.0f}"
        estimate = mib
        if extrapolate:
            base = one["stages"].get(stage, (mib,))[0]
            growth = max((mib - base) / (layers - 1), 0.0)
            estimate = mib + growth * (total - layers)
            line += f" {base:11.0f} {growth:10.1f} {estimate:10.0f}"
        whole = max(whole, estimate)
        print(line)
    label = f"extrapolated to {total} layers" if extrapolate else f"measured at {layers} of {total} layers"
    print(f"\nwhole recipe, {label}: {whole:.0f} MiB ({whole / whole_mib:.2f} of the float32 model); "
          f"target < {LIMIT_MIB} MiB: {'PASS' if whole < LIMIT_MIB else 'FAIL'}")


if __name__ == "__main__":
    main()
