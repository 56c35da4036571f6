"""bench/engine_roofline.py's GPU rows (``--sections gpu``): one prepared script of about 6 minutes,
every row printed and written as it is measured. Not yet run: no GPU session has had it (the rows
of issue 35's table were measured by hand on 2026-12-04).

The 8B-shaped model is made on the GPU by transformers (random weights, about 30 s to write) and
the 1B by bench/gguf_memory.py's writer; the int4 variants are built by the recipe code (RTN,
groups of 128, compressed-tensors export), and that build is timed as a row of its own.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from engine_roofline import INT4, LLAMA_1B, LLAMA_8B, Rows, decode_rate, synthetic


def copy_bandwidth() -> float:
    """Bytes a second the device moves in a copy (read and write counted): the best of ten 2 GiB copies."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() / best


def make_on_gpu(work: Path, config: dict) -> Path:
    """A random bf16 Llama of ``config``'s shape, made on the GPU and saved (transformers' own init)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = work / f"gpu-llama-{config['num_hidden_layers']}x{config['hidden_size']}"
    if not (dest / "config.json").exists():
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")}
        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(**fields, torch_dtype=torch.bfloat16)).to(torch.bfloat16)
        model.save_pretrained(dest)
        del model
        _free()
    return dest


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def ours_batch(path: Path, sequences: int, prompt: int, tokens: int) -> float:
    """Output tokens a second of ``sequences`` requests submitted together (greedy, EOS ignored)."""
    from runner.engine.llm import LLM
    from runner.engine.sampling import SamplingParams

    llm = LLM(path, dtype="bf16", max_num_seqs=max(sequences, 1), max_model_len=prompt + tokens + 16)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 8000 + 100 for j in range(prompt)] for i in range(sequences)]
    llm.generate(prompts[: min(4, sequences)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    del llm
    _free()
    return sum(len(o.token_ids) for o in outs) / seconds


def ours_one(path: Path) -> float:
    from runner.engine.llm import LLM

    llm = LLM(path, dtype="bf16", max_num_seqs=4, max_model_len=1024)
    decode_rate(llm, prompt=128, tokens=8)
    rate = decode_rate(llm, prompt=128, tokens=128)
    del llm
    _free()
    return rate


def transformers_static(path: Path, sequences: int, prompt: int, tokens: int) -> float:
    """``generate`` on one static batch (all prompts the same length: no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
    ids = torch.tensor([[(7 * i + j) % 8000 + 100 for j in range(prompt)] for i in range(sequences)], device="cuda")
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    _free()
    return sequences * tokens / seconds


def transformers_continuous(path: Path, sequences: int, prompt: int, tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                 attn_implementation="sdpa").eval()
    manager = model.init_continuous_batching(generation_config=GenerationConfig(
        max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0))
    manager.start()
    try:
        start = time.perf_counter()
        for i in range(sequences):
            manager.add_request([(7 * i + j) % 8000 + 100 for j in range(prompt)], max_new_tokens=tokens)
        done = produced = 0
        while done < sequences:
            result = manager.get_result(timeout=120)
            if result is not None and result.is_finished():
                done += 1
                produced += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    del model
    _free()
    return produced / seconds


def int4_variant(model: Path, work: Path) -> tuple[Path, float]:
    """The RTN int4 g128 variant with its compressed-tensors export, and the seconds it took."""
    from engine_roofline import variant

    start = time.perf_counter()
    path = variant(model, work, f"{model.name}-int4-g128", INT4)
    return path, time.perf_counter() - start


def _guarded(rows: Rows, name: str, measure) -> float | None:
    """A row measured, or the reason it could not be (the rest of the script goes on)."""
    try:
        value = measure()
    except Exception as e:  # noqa: BLE001: one failed row must not lose the others
        rows.add(name, f"failed: {type(e).__name__}: {str(e)[:200]}")
        return None
    rows.add(name, {"tokens_per_s": round(value, 1)})
    return value


def run(rows: Rows, work: Path) -> dict[str, float]:
    import torch

    rows.add("GPU", torch.cuda.get_device_name())
    bandwidth = copy_bandwidth()
    rows.add("copy bandwidth, TB/s", round(bandwidth / 1e12, 2))
    ratios = {}
    small = synthetic(work, LLAMA_1B)
    big = make_on_gpu(work, LLAMA_8B)
    floors = {name: bandwidth / sum(f.stat().st_size for f in path.glob("*.safetensors")) for name, path in
              (("8B", big), ("1B", small))}
    rows.add("floors, tokens/s (weights / copy bandwidth)", {k: round(v, 1) for k, v in floors.items()})

    one = _guarded(rows, "8B one sequence, ours bf16", lambda: ours_one(big))
    if one:
        ratios["8B one sequence bf16, of the floor (target >= 0.5)"] = one / floors["8B"]
    _guarded(rows, "8B one sequence, transformers generate", lambda: transformers_static(big, 1, 128, 64))
    b64 = _guarded(rows, "8B 64 at once, 128 out, ours bf16", lambda: ours_batch(big, 64, 128, 128))
    _guarded(rows, "8B 64 at once, 128 out, transformers one static batch", lambda: transformers_static(big, 64, 128, 128))
    _guarded(rows, "1B one sequence, ours bf16", lambda: ours_one(small))
    b256 = _guarded(rows, "1B 256 at once, 256 out, ours bf16", lambda: ours_batch(small, 256, 128, 256))
    _guarded(rows, "1B 256 at once, transformers static", lambda: transformers_static(small, 256, 128, 256))
    cont = _guarded(rows, "1B 256 at once, transformers continuous batching",
                    lambda: transformers_continuous(small, 256, 128, 256))
    if b256:
        ratios["1B at 256 vs 9,549 tokens/s of 2026-12-04 (target >= 2)"] = b256 / 9549
        if cont:
            ratios["1B at 256 vs transformers continuous batching (target >= 3)"] = b256 / cont

    try:
        int4, seconds = int4_variant(big, work)
        rows.add("8B int4 g128 variant built (RTN + compressed-tensors export), s", round(seconds, 1))
    except Exception as e:  # noqa: BLE001
        rows.add("8B int4 g128 variant built", f"failed: {type(e).__name__}: {str(e)[:200]}")
        return ratios
    q1 = _guarded(rows, "8B one sequence, ours int4 g128", lambda: ours_one(int4))
    q64 = _guarded(rows, "8B 64 at once, ours int4 g128", lambda: ours_batch(int4, 64, 128, 128))
    b256_8b = _guarded(rows, "8B 256 at once, 128 out, ours bf16", lambda: ours_batch(big, 256, 128, 128))
    q256 = _guarded(rows, "8B 256 at once, 128 out, ours int4 g128", lambda: ours_batch(int4, 256, 128, 128))
    for label, q, b, target in (("one sequence", q1, one, 1.7), ("64", q64, b64, 1.0), ("256", q256, b256_8b, 0.8)):
        if q and b:
            ratios[f"8B int4 vs bf16 at {label} (target >= {target})"] = q / b
    return ratios
