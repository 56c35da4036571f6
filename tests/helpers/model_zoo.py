"""Small random-weight models of the architectures customers bring, made here with transformers
and the bundled tokenizer: each shape's conventions (Gemma's norms, soft-caps and sliding-window
pattern, Qwen3's q/k norms, Phi-3's fused projections, Llama 3.2's tied head and rope scaling) on
a model small enough to run in a test.

Windows are short (32 tokens) so that a 128-token check crosses them, and Gemma 3 has seven
layers so that its pattern (five sliding, one global) shows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import EVAL_TEXT, TINY

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512, rms_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.2)
WINDOW = 32

ZOO = {
    "qwen3": ("qwen3", dict(head_dim=64)),
    "llama3.2": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "gemma2": ("gemma2", dict(num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW,
                              tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.1)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=7, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW,
                                   tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.1)),
    "phi3": ("phi3", dict()),
}


def make_model(folder: Path, model_type: str, tokenizer_from: Path | None = TINY, **extra) -> Path:
    """A random model of ``model_type`` saved at ``folder`` with the tokenizer of ``tokenizer_from``
    (None: none); biases and norm weights random too, so that a wrong bias, norm offset or norm
    placement shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**BASE, **extra})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5) if config.model_type.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_from else ():
        shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


def zoo_model(folder: Path, name: str) -> Path:
    model_type, extra = ZOO[name]
    return make_model(folder, model_type, **extra)


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's GELU on the CPU: the tanh GELU looked up in a table of every fp16 value (GGML_GELU_FP16)."""
    table = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


class _GGMLGelu(torch.nn.Module):
    def forward(self, x):
        return ggml_gelu(x)


def llama_cpp_and_transformers(folder, tmp_path, n: int = 128):
    """Log-probabilities of the evaluation text's first ``n`` tokens from llama.cpp (our F32 GGUF,
    F32 cache) and from transformers; transformers' GELU computed as ggml computes it, so that what
    is compared is the model, not a 1e-3 activation table."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from formats.hf import HFCheckpoint
    from recipes.variants import build_variant, gguf_variant

    path = build_variant(HFCheckpoint.open(folder), gguf_variant("F32"), tmp_path,
                         gguf_path=tmp_path / "m.gguf").files[0]
    ids = AutoTokenizer.from_pretrained(folder)(EVAL_TEXT.read_text()[:4000], add_special_tokens=False)["input_ids"][:n]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    llm.eval(ids)
    ours = torch.log_softmax(torch.tensor(np.asarray(llm.scores[: len(ids)]), dtype=torch.float64), -1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if model.config.model_type.startswith("gemma"):
        for layer in model.model.layers:
            layer.mlp.act_fn = _GGMLGelu()
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return ours, ref
