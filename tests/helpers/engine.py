"""The engine's tests' models and prompts: random-weight models of a few shapes, prompts of mixed
lengths from the evaluation text, greedy decoding through our engine and through transformers'
`generate`; and the quantized variants (with their exports) the quantized-engine tests load."""

from __future__ import annotations

import pytest
import torch

from conftest import BUNDLED, EVAL_TEXT, TINY
from runner import LLM, SamplingParams

LENGTHS = [3, 17, 40, 1, 64, 9, 25, 90, 5, 33, 12, 70, 2, 48, 21, 7]  # 16 prompts of mixed lengths
OUTPUT = 20


def random_model(folder, model_type: str, **config):
    """A random-weight model with peaked next-token distributions (large initial weights), so that
    greedy decoding is decided by clear margins, and the bundled tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=8192, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(base | config)), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # zero at init: make them matter
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder)
    return folder


def prompts_from_text(count_lengths=LENGTHS) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(TINY)(EVAL_TEXT.read_text()[:40000])["input_ids"]
    return [ids[300 * i : 300 * i + n] for i, n in enumerate(count_lengths)]


def transformers_greedy(path, prompts, max_tokens=OUTPUT) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def greedy(path, prompts, max_tokens=OUTPUT, **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="fp32", **({"kv_memory": 32 * 2**20} | engine))
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == max_tokens for o in outs)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks  # every block back
    return [o.token_ids for o in outs], llm


VARIANTS = {
    "int8": ({"method": "rtn", "bits": 8}, ["compressed-tensors", "gptq"], "int8"),
    "int8-asym": ({"method": "rtn", "bits": 8, "symmetric": False}, ["compressed-tensors"], "int8"),
    "int4-g64": ({"method": "rtn", "bits": 4, "granularity": "group", "group_size": 64}, ["compressed-tensors", "gptq"], "int4"),
    "int4-g128-asym": ({"method": "rtn", "bits": 4, "symmetric": False, "granularity": "group", "group_size": 128},
                       ["compressed-tensors", "gptq"], "int4"),
    "gptq-int4-actorder": ({"method": "gptq", "bits": 4, "group_size": 64, "act_order": True}, ["gptq"], "int4"),
    "int3-g64": ({"method": "rtn", "bits": 3, "granularity": "group", "group_size": 64}, ["compressed-tensors"],
                 "dequantized int3-g64-sym"),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    from calib.text import sample_windows
    from formats.hf import HFCheckpoint, load_tokenizer
    from recipes.schema import Variant
    from recipes.variants import build_variant

    out = tmp_path_factory.mktemp("quantized")
    ckpt = HFCheckpoint.open(TINY)
    calibration = sample_windows(load_tokenizer(ckpt), BUNDLED / "calib.txt", 128, 8)
    for name, (weights, exports, _) in VARIANTS.items():
        variant = Variant.model_validate({"name": name, "weights": weights, "exports": ["safetensors", *exports]})
        build_variant(ckpt, variant, out, calibration=calibration)
    return out
