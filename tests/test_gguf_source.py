"""A GGUF file as the source: read as transformers reads it, converted to another type with every
tensor whose type does not change kept byte for byte, scored in a recipe beside its original, run
by the engine; a file that is not a model quantbench reads is refused in one line.

(Per architecture, the F32 round trip through our own files is in test_architectures.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import EVAL_TEXT, TINY
from formats.gguf_source import GGUFCheckpoint
from formats.hf import HFCheckpoint, load_tokenizer
from formats.sources import open_checkpoint
from recipes.variants import build_variant, gguf_variant


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bundled model as Q8_0 and Q4_K_M files (byte-identical to llama.cpp's own, test_gguf_exact.py)."""
    out = tmp_path_factory.mktemp("gguf-sources")
    ckpt = HFCheckpoint.open(TINY)
    return {t: build_variant(ckpt, gguf_variant(t), out, gguf_path=out / f"tiny-{t}.gguf").files[0]
            for t in ("Q8_0", "Q4_K_M", "F32")}


@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_K_M"])
def test_a_gguf_file_reads_as_transformers_reads_it(files, file_type):
    from transformers import AutoModelForCausalLM

    path = files[file_type]
    source = open_checkpoint(path)
    assert isinstance(source, GGUFCheckpoint) and source.label == f"gguf {file_type}"
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert sorted(source.names) == sorted(n for n in theirs if n != "lm_head.weight")  # tied
    for name in source.names:
        assert torch.equal(source.tensor(name), theirs[name]), name
    assert source.arch == HFCheckpoint.open(TINY).arch  # the model the file was made from, as its config.json has it


def test_the_files_tokenizer_tokenizes_as_the_original(files):
    text = EVAL_TEXT.read_text()[:5000]
    ours = load_tokenizer(open_checkpoint(files["Q8_0"]))(text)["input_ids"]
    assert ours == load_tokenizer(HFCheckpoint.open(TINY))(text)["input_ids"]


def test_converting_to_the_same_type_gives_the_same_file(files, tmp_path):
    for file_type in ("Q4_K_M", "Q8_0"):
        again = build_variant(open_checkpoint(files[file_type]), gguf_variant(file_type), tmp_path,
                              gguf_path=tmp_path / f"{file_type}.gguf").files[0]
        assert again.read_bytes() == files[file_type].read_bytes(), file_type


def test_a_q8_0_file_converts_to_q4_k_m_as_its_original_does(files, tmp_path):
    """Q8_0 to Q4_K_M: the norms (F32 in both) keep their bytes, the rest is quantized again from
    the Q8_0 values, and llama.cpp's perplexity is the Q4_K_M of the original's within 0.5%."""
    from gguf import GGUFReader

    from helpers.llama_cpp_scores import llama_cpp_perplexity

    converted = build_variant(open_checkpoint(files["Q8_0"]), gguf_variant("Q4_K_M"), tmp_path,
                              gguf_path=tmp_path / "q4.gguf").files[0]
    source = {t.name: t for t in GGUFReader(files["Q8_0"]).tensors}
    kept = [t for t in GGUFReader(converted).tensors if t.tensor_type == source[t.name].tensor_type]
    assert kept and all(bytes(t.data) == bytes(source[t.name].data) for t in kept)
    assert {t.tensor_type.name for t in kept} == {"F32"}
    tokens = load_tokenizer(HFCheckpoint.open(TINY))(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"][: 8 * 256]
    ppl = {name: llama_cpp_perplexity(p, tokens) for name, p in
           (("Q8_0", files["Q8_0"]), ("from Q8_0", converted), ("from the original", files["Q4_K_M"]))}
    print("llama.cpp perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items()))
    assert abs(ppl["from Q8_0"] / ppl["from the original"] - 1) < 0.005


def test_a_recipe_scores_a_gguf_file_beside_its_original(files, tmp_path):
    from rich.console import Console

    from conftest import write_recipe
    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(files["Q8_0"]), "reference": str(TINY),
              "evaluation": {"text": str(EVAL_TEXT), "window": 128, "max_windows": 4},
              "variants": [{"name": "q4_k_m", "weights": {"method": "gguf", "type": "Q4_K_M"}, "exports": ["gguf"]}]}
    report = run_recipe(load_recipe(write_recipe(tmp_path, recipe)), tmp_path / "out", Console(quiet=True))
    original, model, q4 = report.rows
    assert model.method == "source (gguf Q8_0)" and 8 < model.bits_per_weight < 9
    assert 0 < model.scores.kld < q4.scores.kld
    assert (tmp_path / "out" / "q4_k_m" / "q4_k_m.gguf").is_file() or any((tmp_path / "out" / "q4_k_m").glob("*.gguf"))


def test_the_engine_runs_a_gguf_file_as_transformers_runs_its_weights(files):
    from transformers import AutoModelForCausalLM

    from runner import LLM, SamplingParams

    path = files["Q4_K_M"]
    llm = LLM(str(path), dtype="float32")
    prompt = llm.tokenizer("The history of the city", add_special_tokens=False)["input_ids"]
    ours = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(prompt):]
    assert list(ours) == theirs.tolist()


def _rewrite(src, dst, *, drop: str | None = None, fields: dict | None = None) -> None:
    """A copy of the F32 GGUF file ``src`` without tensor ``drop`` and with ``fields`` (key -> str) replaced."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(src)
    arch = (fields or {}).get("general.architecture", reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (fields or {}).get(key, field.contents())
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, np.asarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("change, fragment", [
    (dict(fields={"general.architecture": "bert"}), "GGUF architecture 'bert' is not one quantbench reads"),
    (dict(drop="blk.3.ffn_down.weight"), "no tensor 'blk.3.ffn_down.weight' (the llama model's model.layers.3.mlp.down_proj.weight)"),
])
def test_a_gguf_file_that_is_not_a_model_quantbench_reads_is_refused_in_one_line(files, tmp_path, monkeypatch, capsys,
                                                                                 change, fragment):
    from helpers.cli import quantize

    bad = tmp_path / "bad.gguf"
    _rewrite(files["F32"], bad, **change)
    code, out, err = quantize(monkeypatch, capsys, "export", bad, "--gguf", "Q4_K_M", "-o", tmp_path / "m.gguf")
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m.gguf").exists()
