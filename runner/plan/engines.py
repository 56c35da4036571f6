"""Which engine serves a plan, and the exact commands to start it (docs/plan.md, "Which engine").

The rule, by hardware and load:
- a laptop, a Mac or a CPU (no NVIDIA or AMD GPU): llama.cpp, through Ollama for one user, with the
  variant's GGUF file (made by ``quantize export`` where the variant has none); a CPU server with
  a safetensors or compressed-tensors variant: ``quantize serve``;
- NVIDIA or AMD GPUs, many users: vLLM (SGLang takes the same flags) with the compressed-tensors,
  GPTQ or AWQ export, tensor parallel inside a node and data parallel across copies; a variant
  whose only file is GGUF, or whose KV cache is llama.cpp's q8_0/q4_0: llama.cpp's server;
- strict TTFT and TPOT together at scale, where the split is what meets them or is cheaper:
  disaggregated prefill and decode (SGLang's PD mode and its router).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from runner.fit.gpus import GPU
from runner.plan.variants import PlanVariant

_VLLM_FORMATS = ("compressed-tensors", "gptq", "awq")
_LLAMACPP_KV = {"int8": "q8_0", "int4": "q4_0"}


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "ollama", "llama.cpp", "quantize serve", "vllm", "sglang-pd"
    weights: str  # the file or folder it loads
    why: str
    commands: list[str] = field(default_factory=list)
    alternative: list[str] = field(default_factory=list)  # the same deployment on another engine


def is_local(gpu: GPU) -> bool:
    """A laptop, a Mac or a CPU: one device, no datacenter serving stack."""
    return gpu.vendor not in ("nvidia", "amd")


def servable(variant: PlanVariant, gpu: GPU) -> str | None:
    """Why no engine can serve ``variant`` on ``gpu`` at its bytes, or None when one can."""
    source = _source(variant)
    if is_local(gpu):
        if source or "gguf" in variant.exports or "compressed-tensors" in variant.exports:
            return None
        return "no GGUF file (llama.cpp) or compressed-tensors export (quantize serve) to run it locally"
    if source or "gguf" in variant.exports:
        return None
    if variant.kv_cache in _LLAMACPP_KV:
        return f"its {variant.kv_cache} KV cache is llama.cpp's, and the variant has no GGUF file"
    if any(f in variant.exports for f in _VLLM_FORMATS):
        return None
    return "no export an engine serves at these bytes (add compressed-tensors, gptq, awq or gguf to its exports)"


def _source(variant: PlanVariant) -> bool:
    """The model's own weights (the original, or a KV-cache-only variant)."""
    return variant.original or variant.method.startswith("source")


def choose_engine(model: str, variant: PlanVariant, gpu: GPU, tp: int, copies: int, users_per_copy: int, context: int,
                  chunk: int, disaggregated: tuple[int, int] | None = None) -> EngineChoice:
    """The engine and commands for ``copies`` copies of ``tp`` GPUs each; ``disaggregated``:
    (prefill instances, decode instances) instead."""
    if is_local(gpu):
        return _local(model, variant, users_per_copy, context)
    gguf = variant.exports.get("gguf")
    weights = next((str(variant.exports[f]) for f in _VLLM_FORMATS if f in variant.exports), None)
    if weights is None and (gguf is not None or variant.kv_cache in _LLAMACPP_KV):
        path = str(gguf) if gguf else "model.gguf"
        return EngineChoice("llama.cpp", path, "the variant is a GGUF file (or keeps llama.cpp's KV cache): llama.cpp's server",
                            _gguf_first(model, gguf) + [_llama_server(path, variant.kv_cache, users_per_copy, context, gpu=True)])
    weights = weights or model
    if disaggregated is not None:
        return _pd(weights, variant, tp, disaggregated, context)
    kv = ["--kv-cache-dtype", "fp8"] if variant.kv_cache == "fp8" else []
    vllm = ["vllm", "serve", weights, "--tensor-parallel-size", str(tp), "--max-model-len", str(context),
            "--max-num-seqs", str(users_per_copy), "--enable-chunked-prefill", "--max-num-batched-tokens", str(chunk),
            "--enable-prefix-caching", *kv]
    if copies > 1:
        vllm += ["--data-parallel-size", str(copies)] if copies * tp <= gpu.gpus_per_node else []
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", weights, "--tp", str(tp), "--context-length", str(context),
              "--max-running-requests", str(users_per_copy), "--chunked-prefill-size", str(chunk),
              *(["--kv-cache-dtype", "fp8_e4m3"] if variant.kv_cache == "fp8" else [])]
    if copies > 1:
        sglang += ["--dp", str(copies)] if copies * tp <= gpu.gpus_per_node else []
    spread = "" if copies * tp <= gpu.gpus_per_node else f" (one server per copy on {copies} copies, behind a load balancer)"
    return EngineChoice("vllm", weights, f"many users on {gpu.vendor.upper()} GPUs: continuous batching with chunked prefill" + spread,
                        [_join(vllm)], [_join(sglang)])


def _local(model: str, variant: PlanVariant, users: int, context: int) -> EngineChoice:
    gguf = variant.exports.get("gguf")
    if gguf is None and not _source(variant) and "compressed-tensors" in variant.exports:
        folder = str(variant.exports["compressed-tensors"])
        return EngineChoice("quantize serve", folder, "a CPU server with the variant's safetensors files: our engine",
                            [_join(["quantize", "serve", folder, "--max-num-seqs", str(users), "--max-model-len", str(context)])])
    path = str(gguf) if gguf else "model.gguf"
    first = _gguf_first(model, gguf)
    if users == 1:
        modelfile = str(Path(path).with_suffix(".Modelfile"))
        name = Path(path).stem.lower()
        if gguf is not None and Path(path).is_file() and not Path(modelfile).is_file():  # a GGUF file we did not write
            first = first + [f"printf 'FROM %s\\n' {shlex.quote(path)} > {shlex.quote(modelfile)}"]
        return EngineChoice("ollama", path, "one user on a laptop or CPU: llama.cpp through Ollama, with the GGUF file",
                            first + [_join(["ollama", "create", name, "-f", modelfile]), _join(["ollama", "run", name])],
                            [_llama_server(path, variant.kv_cache, users, context, gpu=False)])
    return EngineChoice("llama.cpp", path, "a few users on one local device: llama.cpp's server with parallel slots",
                        first + [_llama_server(path, variant.kv_cache, users, context, gpu=False)])


def _gguf_first(model: str, gguf: Path | None) -> list[str]:
    """The export that makes the GGUF file (with its Modelfile) where the variant, the model's own
    16-bit weights, has none: F16, the bytes planned."""
    return [] if gguf else [_join(["quantize", "export", model, "--gguf", "F16", "--out", "model.gguf"])]


def _llama_server(path: str, kv: str, users: int, context: int, gpu: bool) -> str:
    cache = ["--cache-type-k", _LLAMACPP_KV[kv], "--cache-type-v", _LLAMACPP_KV[kv], "--flash-attn", "on"] if kv in _LLAMACPP_KV else []
    return _join(["llama-server", "-m", path, "--ctx-size", str(context * users), "--parallel", str(users),
                  *(["--n-gpu-layers", "999"] if gpu else []), *cache])


def _pd(weights: str, variant: PlanVariant, tp: int, pools: tuple[int, int], context: int) -> EngineChoice:
    prefill, decode = pools
    kv = ["--kv-cache-dtype", "fp8_e4m3"] if variant.kv_cache == "fp8" else []
    common = ["python", "-m", "sglang.launch_server", "--model-path", weights, "--tp", str(tp), "--context-length", str(context), *kv,
              "--disaggregation-transfer-backend", "nixl"]
    commands = [f"# {prefill} prefill server(s), ports 30000..., and {decode} decode server(s), ports 31000...",
                _join([*common, "--disaggregation-mode", "prefill", "--port", "30000"]),
                _join([*common, "--disaggregation-mode", "decode", "--port", "31000"]),
                _join(["python", "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", "http://127.0.0.1:30000",
                       "--decode", "http://127.0.0.1:31000", "--port", "8000"])]
    return EngineChoice("sglang-pd", weights, "strict TTFT and TPOT together at scale: prefill and decode on separate pools", commands)


def _join(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)
