"""Measured speed for the report (a recipe's ``speed``): each variant on the same workload, run
where its files run. The engine runs the original, KV-cache variants (the original's weights with
the quantized cache) and variants with a compressed-tensors or GPTQ export (on their low-bit
weights); llama.cpp (llama-cpp-python) runs GGUF files. Other variants have nothing that runs as
themselves (a dense export is the original's speed) and get no speed, with the reason."""

from __future__ import annotations

from pathlib import Path

from core.errors import InputError
from formats.registry import ENGINE_EXPORTS, FORMATS
from recipes.schema import Speed, Variant
from runner.bench import BenchResult, Workload, output_lengths, run_bench, run_llama_cpp, workload_prompts

_ENGINE_EXPORTS = [e for e in ENGINE_EXPORTS if FORMATS[e].codes]  # the exports the engine runs on their low-bit weights


def workload(speed: Speed) -> Workload:
    return Workload(speed.requests, speed.concurrency, tuple(speed.prompt_tokens), tuple(speed.output_tokens))


def measure(model: Path, variant: Variant | None, files: list[Path], speed: Speed, text: Path, tokenizer) -> dict:
    """The speed row of ``variant`` (None: the original) whose exports are ``files``."""
    from runner.engine.llm import LLM

    w = workload(speed)
    gguf = next((f for f in files if f.suffix == ".gguf"), None)
    if gguf is not None:
        try:
            return _row("llama.cpp", run_llama_cpp(gguf, workload_prompts(tokenizer, text, w), output_lengths(w)))
        except ImportError:
            return {"runner": None, "note": "llama-cpp-python is not installed (pip install quantbench[interop])"}
    source = engine_source(model, variant, files)
    if isinstance(source, str):
        return {"runner": None, "note": source}
    path, cache = source
    try:
        return _row("quantbench", run_bench(LLM(path, kv_cache_dtype=cache, kv_memory=0.25), text, w))
    except InputError as e:
        return {"runner": None, "note": str(e)}


def engine_source(model: Path, variant: Variant | None, files: list[Path]) -> tuple[Path, str] | str:
    """What the engine runs as ``variant`` (None: the original), with which KV cache, or why it
    cannot: the source model for the original and KV-cache variants, else a compressed-tensors or
    GPTQ export; not quantized activations, which it has no kernels for."""
    if variant is not None and variant.activations is not None:
        return "the engine has no quantized-activation kernels"
    source = model if variant is None or variant.weights.method == "none" else \
        next((f for f in files if f.name in _ENGINE_EXPORTS), None)
    if source is None:
        return "no export that runs as the variant itself (compressed-tensors, GPTQ or GGUF)"
    return source, variant.kv_cache.format if variant is not None and variant.kv_cache else "auto"


def _row(runner: str, r: BenchResult) -> dict:
    return {"runner": runner, "concurrency": r.concurrency, "output_tokens_per_s": r.output_tokens_per_s,
            "ttft_ms": 1000 * r.ttft_s.mean, "tpot_ms": 1000 * r.tpot_s.mean}
