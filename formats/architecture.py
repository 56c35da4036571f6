"""What a model's config.json says its tensors are: transformers' own model, built on the meta device.

Building the model from its config without storage gives, for every architecture transformers
knows, the exact list of tensors a checkpoint must hold (names, shapes, tied heads, biases,
experts), so a checkpoint is checked against the model it claims to be before any work starts,
and the memory-fit calculator counts the same parameters a real load would.

The config's sizes are checked first: a config is as untrusted as the weights, and a layer count
of a billion would otherwise keep transformers building modules for hours.
"""

from __future__ import annotations

import torch

from quant.types import InputError

# Sizes a config gives, each a positive integer no larger than this (well beyond any real model:
# the module count, layers times experts, is what building costs).
_SIZE_LIMITS = {
    "num_hidden_layers": 1024, "num_local_experts": 4096, "n_routed_experts": 4096, "num_experts": 4096,
    "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "moe_intermediate_size": 1 << 22,
    "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14, "head_dim": 1 << 16,
    "vocab_size": 1 << 26, "max_position_embeddings": 1 << 31, "sliding_window": 1 << 31,
    "num_experts_per_tok": 4096, "kv_lora_rank": 1 << 16, "qk_rope_head_dim": 1 << 16, "qk_nope_head_dim": 1 << 16,
}


def transformers_config(config: dict, where: str):
    """The transformers config of a config.json's contents; ``where`` names it in errors."""
    from transformers import AutoConfig

    check_sizes(config, where)
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise InputError(f"{where}: config has no model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers raises whatever its config code hits on a bad value
        raise InputError(f"{where}: transformers cannot read this {model_type} config ({_first_line(e)})") from None


def meta_model(config, where: str) -> torch.nn.Module:
    """The causal LM of a transformers ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # a config transformers accepted can still fail to build (sizes that do not divide)
        raise InputError(f"{where}: transformers cannot build model_type '{config.model_type}' ({_first_line(e)})") from None


def expected_tensors(config: dict, where: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors a checkpoint of this config holds, name -> shape, and those it may leave out
    (an output head tied to the embedding)."""
    model = meta_model(transformers_config(config, where), where)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    listed = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return shapes, set(shapes) - listed


def check_sizes(config: dict, where: str) -> None:
    """Refuse a config (or its ``text_config``) whose sizes are not positive integers within reason."""
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        for key, limit in _SIZE_LIMITS.items():
            value = part.get(key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise InputError(f"{where}: {key} is {str(value)[:40]}; it must be a whole number from 1 to {limit:,}")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
