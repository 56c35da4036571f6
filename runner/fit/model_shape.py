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

from core.architecture import Architecture
from core.errors import InputError
from formats.gguf_file import is_gguf_file
from formats.hub import hub_id, local_model

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
    """A model's architecture and its real tensor list, and where the file's exact sizes are known."""

    name: str
    arch: Architecture
    tensors: list[tuple[str, tuple[int, ...]]]  # HF names and shapes; a tied head is listed once
    # a file's tensors, name -> bytes, exactly: a GGUF file, or a quantized checkpoint folder
    stored_bytes: dict[str, int] | None = None
    stored_as: str | None = None  # what holds them: "gguf file", "gptq checkpoint", ...

    @property
    def layers(self) -> list[LayerCache]:
        a = self.arch
        return [LayerCache(a.cache_values_per_token(i), a.windows[i], None if a.latent_cache is not None else a.kv_heads[i])
                for i in range(a.layers)]

    @property
    def intermediate(self) -> int:
        """The MLP width one token's forward pass goes through (its experts together, shared ones included)."""
        a = self.arch
        return a.intermediate * (a.experts_per_token + a.shared_experts) if a.experts else a.intermediate

    @property
    def expert_fraction(self) -> float:
        """The share of the expert tensors one token reads (top-k / experts); 1 for a dense model."""
        return self.arch.experts_per_token / self.arch.experts if self.arch.experts else 1.0

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
    """``model``: a bundled preset name, a model folder, a config.json, a GGUF file, or a Hugging
    Face id, of which only config.json is fetched (the shape is all the calculator reads)."""
    ident = hub_id(model)
    if ident is not None:
        return replace(load_model_shape(str(local_model(model, config_only=True))), name=str(ident))
    path = Path(model)
    if path.suffix == ".gguf" or (path.is_file() and is_gguf_file(path)):
        from runner.fit.gguf_shape import gguf_model_shape

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
    from formats.architecture import from_transformers, meta_model, transformers_config

    hf = transformers_config(config, name)
    tensors = [(n, tuple(p.shape)) for n, p in meta_model(hf, name).named_parameters()]
    return ModelShape(name=name, arch=from_transformers(hf, config, name), tensors=tensors)


def _read_config(path: Path) -> dict:
    from formats.hf import read_json

    config = read_json(path)
    if not isinstance(config, dict):
        raise InputError(f"{path}: a config.json is a JSON object")
    return config


def suggest_names(name: str, known: list[str]) -> str:
    """' (did you mean a, b?)' for the known names closest to ``name``, else ' (one of: ...)'."""
    import difflib

    close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else f" (one of: {', '.join(known)})"
