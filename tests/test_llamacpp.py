"""Our GGUF files as llama.cpp (through llama-cpp-python) reads them: tokens, log-probs, perplexity."""

import math

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the 'interop' extra (make test installs it)")

from conftest import EVAL_TEXT, TINY  # noqa: E402

WINDOW = 512


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def windows(hf):
    tok, _ = hf
    ids = tok(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    n = len(ids) // WINDOW
    return np.array(ids[: n * WINDOW]).reshape(n, WINDOW)


def load(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=WINDOW, n_batch=WINDOW, logits_all=True, verbose=False, n_threads=2, seed=0)


def llama_logprobs(llm, window) -> np.ndarray:
    llm.reset()
    llm.eval(window.tolist())
    logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def hf_logprobs(model, window) -> np.ndarray:
    with torch.inference_mode():
        logits = model(input_ids=torch.from_numpy(window)[None]).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).numpy()


def perplexity(logprob_fn, windows) -> float:
    nll = sum(-logprob_fn(w)[np.arange(WINDOW - 1), w[1:]].sum() for w in windows)
    return math.exp(nll / (len(windows) * (WINDOW - 1)))


def test_llama_cpp_tokenizes_the_evaluation_text_like_transformers(small_run, hf):
    out, _ = small_run
    tok, _ = hf
    text = EVAL_TEXT.read_text()
    llm = llama_cpp.Llama(model_path=str(out / "q8_0" / "tiny-Q8_0.gguf"), vocab_only=True, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok(text, add_special_tokens=False)["input_ids"]
    assert llm.token_bos() == 0 and llm.token_eos() == 0


def test_q8_0_perplexity_within_one_percent_of_the_original(small_run, hf, windows):
    out, _ = small_run
    _, model = hf
    llm = load(out / "q8_0" / "tiny-Q8_0.gguf")
    ppl_gguf = perplexity(lambda w: llama_logprobs(llm, w), windows)
    ppl_original = perplexity(lambda w: hf_logprobs(model, w), windows)
    print(f"{len(windows)} windows: original (transformers) {ppl_original:.4f}, Q8_0 (llama.cpp) {ppl_gguf:.4f}")
    assert abs(ppl_gguf / ppl_original - 1) < 0.01


def test_f16_gguf_gives_the_original_log_probs(small_run, hf, windows):
    out, _ = small_run
    _, model = hf
    llm = load(out / "f16" / "tiny-F16.gguf")
    ours = llama_logprobs(llm, windows[0])
    ref = hf_logprobs(model, windows[0])
    assert np.abs(ours - ref).mean() < 2e-3
    assert (ours.argmax(1) == ref.argmax(1)).mean() > 0.99


def test_gguf_generates_text(small_run):
    out, _ = small_run
    llm = load(out / "q8_0" / "tiny-Q8_0.gguf")
    text = llm.create_completion("Captain Wentworth", max_tokens=16, temperature=0.0)["choices"][0]["text"]
    assert len(text.split()) >= 3


def test_our_q4_k_m_has_the_perplexity_of_llama_cpps_own(tmp_path, windows):
    """Same bytes, same numbers: our one-step Q4_K_M against llama.cpp's F32 -> quantize path."""
    from helpers.ggml_oracle import llama_quantize_file

    from formats.hf import HFCheckpoint
    from core.file_types import FILE_TYPES
    from recipes.variants import build_variant, gguf_variant

    ckpt = HFCheckpoint.open(TINY)
    ours = build_variant(ckpt, gguf_variant("Q4_K_M"), tmp_path, gguf_path=tmp_path / "ours.gguf").files[0]
    f32 = build_variant(ckpt, gguf_variant("F32"), tmp_path, gguf_path=tmp_path / "f32.gguf").files[0]
    llama_quantize_file(f32, tmp_path / "theirs.gguf", FILE_TYPES["Q4_K_M"].id)
    sample = windows[:16]
    ours_llm, theirs_llm = load(ours), load(tmp_path / "theirs.gguf")
    ppl_ours = perplexity(lambda w: llama_logprobs(ours_llm, w), sample)
    ppl_theirs = perplexity(lambda w: llama_logprobs(theirs_llm, w), sample)
    print(f"Q4_K_M perplexity in llama.cpp, {len(sample)} windows: ours {ppl_ours:.4f}, llama.cpp's {ppl_theirs:.4f}")
    assert ppl_ours == ppl_theirs
    text = ours_llm.create_completion("Anne Elliot", max_tokens=12, temperature=0.0)["choices"][0]["text"]
    assert len(text.split()) >= 3


@pytest.mark.parametrize("fmt, ggml_type", [("int8", 8), ("int4", 2)])
def test_simulated_kv_cache_predicts_llama_cpps_quantized_cache(small_run, hf, windows, fmt, ggml_type):
    """The recipe's kv_cache simulation against llama.cpp running the F16 file with that cache type
    (-ctk/-ctv q8_0 or q4_0, flash attention, its Hadamard rotation on): q8_0 costs next to nothing
    in both; q4_0's perplexity increase agrees within 10%."""
    from quant.kv_cache import KVCacheSpec, simulated_kv_cache

    out, _ = small_run
    _, model = hf
    sample = windows[:8]
    plain = llama_cpp.Llama(model_path=str(out / "f16" / "tiny-F16.gguf"), n_ctx=WINDOW, n_batch=WINDOW, logits_all=True,
                            verbose=False, n_threads=2, seed=0, flash_attn=True)
    cached = llama_cpp.Llama(model_path=str(out / "f16" / "tiny-F16.gguf"), n_ctx=WINDOW, n_batch=WINDOW, logits_all=True,
                             verbose=False, n_threads=2, seed=0, flash_attn=True, type_k=ggml_type, type_v=ggml_type)
    theirs = perplexity(lambda w: llama_logprobs(cached, w), sample) / perplexity(lambda w: llama_logprobs(plain, w), sample) - 1
    reference = perplexity(lambda w: hf_logprobs(model, w), sample)
    with simulated_kv_cache(model, KVCacheSpec(fmt), interleaved=True):  # llama: rotary pairs side by side
        ours = perplexity(lambda w: hf_logprobs(model, w), sample) / reference - 1
    print(f"{fmt} KV cache, {len(sample)} windows: perplexity {100 * theirs:+.3f}% in llama.cpp, {100 * ours:+.3f}% simulated")
    if fmt == "int8":
        assert abs(theirs) < 0.001 and abs(ours) < 0.001
    else:
        assert theirs > 0.003 and abs(ours / theirs - 1) < 0.1
