"""What the memory-fit calculator needs to know about a model, from any of the forms users have.

A Hugging Face config (a model folder, a config.json, or a bundled preset) is turned into the
model's real parameter list by building the transformers model on the meta device (shapes only, no
memory), so every architecture transformers knows is counted exactly, including tied heads,
biases, mixture-of-experts tensors and DeepSeek's latent attention. A GGUF file carries its tensor
types and sizes; its weights are counted byte for byte.

The KV cache is described per layer: how many values one token adds, and the window of tokens the
layer keeps (sliding-window layers of Gemma and Mistral hold at most ``window`` tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from quant.types import InputError

PRESETS = Path(__file__).resolve().parent / "presets"


@dataclass(frozen=True)
class LayerCache:
    """The KV cache of one attention layer."""

    values_per_token: int  # 2·kv_heads·head_dim; kv_lora_rank + rope dims for a latent (MLA) cache
    window: int | None  # sliding-window layers keep the last ``window`` tokens
    kv_heads: int | None  # None for a latent cache, which every tensor-parallel rank holds whole

    def values_per_token_on(self, tensor_parallel: int) -> float:
        """Values per token on one of ``tensor_parallel`` GPUs: KV heads are split between them
        (replicated where there are fewer heads than GPUs); a latent cache is not split."""
        if self.kv_heads is None:
            return float(self.values_per_token)
        per_head = self.values_per_token // self.kv_heads
        return float(per_head * -(-self.kv_heads // tensor_parallel))


@dataclass(frozen=True)
class ModelShape:
    name: str
    config: dict  # the Hugging Face config (for a GGUF file: the fields rebuilt from its metadata)
    tensors: list[tuple[str, tuple[int, ...]]]  # HF names and shapes; a tied head is listed once
    layers: list[LayerCache]
    hidden: int
    intermediate: int  # per token: a mixture-of-experts layer's active experts together
    vocab: int
    heads: int
    head_dim: int
    max_context: int
    expert_fraction: float  # share of the expert tensors one token reads (top-k / experts); 1 if dense
    # a file's tensors, name -> bytes, exactly: a GGUF file, or a quantized checkpoint folder
    stored_bytes: dict[str, int] | None = None
    stored_as: str | None = None  # what holds them: "gguf file", "gptq checkpoint", ...

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors)

    @property
    def active_parameters(self) -> float:
        """Parameters one token's forward pass reads (mixture of experts: its experts only)."""
        return sum(math.prod(shape) * (self.expert_fraction if is_expert(name) else 1.0) for name, shape in self.tensors)


def is_expert(name: str) -> bool:
    """A mixture-of-experts tensor (transformers' ``mlp.experts.*``, GGUF's ``ffn_*_exps``)."""
    return ".experts." in name or "_exps." in name


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json") if p.stem != "gpus")


def load_model_shape(model: str) -> ModelShape:
    """``model``: a bundled preset name, a model folder, a config.json, or a GGUF file."""
    path = Path(model)
    if path.suffix == ".gguf" or (path.is_file() and _is_gguf(path)):
        from runner.gguf_shape import gguf_model_shape

        return gguf_model_shape(path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise InputError(f"{model}: no config.json in this folder")
    if path.is_file():
        config = _read_config(path)
        shape = shape_from_config(config, path.parent.name if path.name == "config.json" else path.stem)
        quantization = config.get("quantization_config")
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        files = sorted(path.parent.glob("*.safetensors")) if path.name == "config.json" else []
        if method and files:  # a quantized checkpoint: its weights are what its files hold
            from formats.hf import read_safetensors_header

            stored = {name: info["data_offsets"][1] - info["data_offsets"][0]
                      for f in files for name, info in read_safetensors_header(f).tensors.items()}
            return replace(shape, stored_bytes=stored, stored_as=f"{method} checkpoint")
        return shape
    if model in preset_names():
        return shape_from_config(_read_config(PRESETS / f"{model}.json"), model)
    raise InputError(f"{model}: not a preset, a model folder, a config.json or a GGUF file{suggest_names(model, preset_names())}")


def shape_from_config(config: dict, name: str) -> ModelShape:
    """The shape of a model given its Hugging Face config."""
    from formats.architecture import meta_model, transformers_config

    hf = transformers_config(config, name)
    model = meta_model(hf, name)
    tensors = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return ModelShape(
        name=name,
        config=text.to_dict(),
        tensors=tensors,
        layers=_layer_caches(text),
        hidden=text.hidden_size,
        intermediate=_active_intermediate(text),
        vocab=text.vocab_size,
        heads=text.num_attention_heads,
        head_dim=_head_dim(text),
        max_context=int(getattr(text, "max_position_embeddings", 0) or 0),
        expert_fraction=_expert_fraction(text),
    )


def _layer_caches(c) -> list[LayerCache]:
    n = c.num_hidden_layers
    kv_lora = getattr(c, "kv_lora_rank", None)
    if kv_lora:  # DeepSeek's multi-head latent attention caches one compressed vector per token
        return [LayerCache(kv_lora + c.qk_rope_head_dim, None, None)] * n
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    values = 2 * kv_heads * _head_dim(c)
    types = getattr(c, "layer_types", None)
    window = getattr(c, "sliding_window", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n
    return [LayerCache(values, window if t == "sliding_attention" else None, kv_heads) for t in types]


def _head_dim(c) -> int:
    """Query/key width per head (latent attention: its no-rope and rope parts together)."""
    if getattr(c, "kv_lora_rank", None):
        return c.qk_nope_head_dim + c.qk_rope_head_dim
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _experts(c) -> tuple[int, int]:
    """(experts, experts per token); (0, 0) for a dense model."""
    total = getattr(c, "n_routed_experts", None) or getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
    return total, (getattr(c, "num_experts_per_tok", 0) or 0) if total else 0


def _expert_fraction(c) -> float:
    total, active = _experts(c)
    return active / total if total else 1.0


def _active_intermediate(c) -> int:
    total, active = _experts(c)
    if not total:
        return c.intermediate_size
    per_expert = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return per_expert * (active + (getattr(c, "n_shared_experts", 0) or 0))


def _read_config(path: Path) -> dict:
    from formats.hf import read_json

    config = read_json(path)
    if not isinstance(config, dict):
        raise InputError(f"{path}: a config.json is a JSON object")
    return config


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def suggest_names(name: str, known: list[str]) -> str:
    """' (did you mean a, b?)' for the known names closest to ``name``, else ' (one of: ...)'."""
    import difflib

    close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else f" (one of: {', '.join(known)})"
