"""Speculative decoding against plain decoding, at one sequence, on two workloads, in one run.

- The engine's fixed workload (``quantize bench``'s): 32 requests, prompts cut from the evaluation
  text at 32, 64, 128 and 256 tokens in turn, outputs of 16, 64, 128 and 256 tokens in turn,
  greedy, EOS ignored, one request at a time. Plain decoding, n-gram prompt lookup, and the
  bundled tiny model drafting ``--draft-k`` guesses a step.
- A quoting workload, where prompt lookup pays if the model quotes: each prompt is a 192-token
  passage, a blank line and the passage's first 16 tokens again; 96 tokens are asked for. Plain
  decoding against n-gram lookup; the plain row's ``quoted`` is the share of its tokens that are
  the passage's own continuation (how much there was to look up).

Printed per row: output tokens/s, the share of guesses accepted, and the speedup over plain
decoding on the same workload; checked: every row's tokens equal plain decoding's. fp32 by
default, so that the check is exact.

    python bench/speculative.py [--model ../shared/models/ref] [--draft recipes/bundled/tiny] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from printout import print_result  # noqa: E402

TEXT = REPO / "recipes" / "bundled" / "eval.txt"


def fixed_workload(tokenizer) -> list[tuple[list[int], int]]:
    from runner.bench import Workload, output_lengths, workload_prompts

    w = Workload(requests=32, concurrency=1)
    return list(zip(workload_prompts(tokenizer, TEXT, w), output_lengths(w)))


def quote_workload(tokenizer, requests: int = 8) -> list[tuple[list[int], int]]:
    from calib.text import read_text

    ids = tokenizer(read_text(TEXT), add_special_tokens=False)["input_ids"]
    blank = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    passages = [ids[20000 + 400 * i : 20000 + 400 * i + 192] for i in range(requests)]
    return [(p + blank + p[:16], 96) for p in passages]


def run(model: Path, work: list[tuple[list[int], int]], speculative: str | None, dtype: str) -> dict:
    """One request at a time (concurrency 1); tokens/s over the whole workload, after a warm-up."""
    from runner import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_memory=1 << 28, max_num_seqs=1, speculative=speculative)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
    llm.generate(work[0][0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine = llm.engine
    engine.spec_proposed = engine.spec_accepted = 0
    start, tokens = time.perf_counter(), []
    for (prompt, _), p in zip(work, params):
        tokens.append(llm.generate(prompt, p)[0].token_ids)
    seconds = time.perf_counter() - start
    row = {"tokens_per_s": round(sum(map(len, tokens)) / seconds, 1), "seconds": round(seconds, 2)}
    if speculative:
        row["acceptance_rate"] = round(engine.spec_accepted / max(1, engine.spec_proposed), 3)
    return row | {"tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO.parent / "shared" / "models" / "ref")
    parser.add_argument("--draft", type=Path, default=REPO / "recipes" / "bundled" / "tiny")
    parser.add_argument("--draft-k", default="1,2,4", help="guesses a step for the draft rows, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", help="fp32: greedy tokens can be compared exactly (in bf16 a "
                        "verify step's rows round differently from a decode step's, and near ties flip)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from formats.hf import load_tokenizer
    from runner.engine.checkpoint import open_model

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(open_model(args.model))
    rows, ratios, checks = {}, {}, {}
    for name, work, methods in (
        ("fixed", fixed_workload(tokenizer), ["ngram"] + [f"draft={args.draft},k={k}" for k in args.draft_k.split(",")]),
        ("quote", quote_workload(tokenizer), ["ngram"]),
    ):
        plain = rows[f"{name} plain"] = run(args.model, work, None, args.dtype)
        if name == "quote":
            same = sum(a == b for (p, _), out in zip(work, plain["tokens"]) for a, b in zip(out, p[16:192]))
            plain["quoted"] = round(same / sum(map(len, plain["tokens"])), 3)
        for method in methods:
            label = f"{name} {method.replace(str(args.draft), 'tiny')}"
            rows[label] = run(args.model, work, method, args.dtype)
            ratios[f"{label} vs plain (tokens/s, target 1.3)"] = rows[label]["tokens_per_s"] / plain["tokens_per_s"]
            checks[f"{label}: tokens identical to plain decoding"] = rows[label]["tokens"] == plain["tokens"]
    for row in rows.values():
        del row["tokens"]
    print_result(rows, ratios, checks, args.json)


if __name__ == "__main__":
    main()
