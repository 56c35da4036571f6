"""Decode speed on a GPU in three modes, to measure what CUDA graphs and the fused paged-attention
kernel each bring (issue 35): torch's block-by-block decode attention, eager (the engine before
them); the fused kernel, eager (``--enforce-eager``); the fused kernel replayed from CUDA graphs
(the default). The model is a synthetic Llama body with random bf16 weights and the bundled
8192-token vocabulary, of Llama-3.2-1B's shape (or Llama-3-8B's); prompts of 128 tokens, 128
greedy output tokens, EOS ignored, at 1, 64 and 256 sequences at once. Each line is printed as
it is measured, with whether the greedy tokens of a mode equal the first mode's (bf16: a near tie
may part them; the count of equal sequences says how often).

    python bench/decode_graphs.py [--shape 1b|8b] [--batches 1,64,256] [--prompt 128] [--output 128]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
}
MODES = ("torch attention, eager", "fused kernel, eager", "fused kernel, CUDA graphs")


def synthetic(folder: Path, shape: str) -> Path:
    """A Llama body of ``shape`` with random bf16 weights (made on the GPU) and the bundled tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = REPO / "recipes" / "bundled" / "tiny"
    config = LlamaConfig(vocab_size=8192, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0,
                         eos_token_id=0, **SHAPES[shape])
    with torch.device("cuda"):
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder)
    return folder


def measure(path: Path, mode: str, batch: int, prompt: int, output: int) -> tuple[float, float, int, list[list[int]]]:
    """Output tokens/s, the engine's start (capture included), replays, and the greedy tokens."""
    from runner.engine import model
    from runner.engine.llm import LLM
    from runner.engine.sampling import SamplingParams

    fused = model._fused_kernel
    if mode == MODES[0]:
        model._fused_kernel = lambda pool: None
    try:
        start = time.perf_counter()
        llm = LLM(path, dtype="bf16", max_num_seqs=batch, max_model_len=prompt + output + 16, kv_memory=0.3,
                  enforce_eager=mode != MODES[2])
        started = time.perf_counter() - start
        prompts = [[100 + (7919 * i + 31 * j) % 8000 for j in range(prompt)] for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        replays = llm.engine.decoder.replays if llm.engine.decoder is not None else 0
        return batch * output / seconds, started, replays, [o.token_ids for o in outs]
    finally:
        model._fused_kernel = fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    args = parser.parse_args()
    import torch

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape} shape, prompts {args.prompt}, "
          f"outputs {args.output}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic(Path(tmp) / args.shape, args.shape)
        for batch in (int(b) for b in args.batches.split(",")):
            first = None
            for mode in MODES:
                rate, started, replays, tokens = measure(path, mode, batch, args.prompt, args.output)
                first = first or (rate, tokens)
                same = sum(a == b for a, b in zip(tokens, first[1]))
                print(f"{batch:4d} sequences, {mode:26s}: {rate:9,.1f} tokens/s ({rate / first[0]:.2f}x), engine start "
                      f"{started:.1f} s, {replays} replays, {same}/{batch} sequences' tokens as the first mode's", flush=True)


if __name__ == "__main__":
    main()
