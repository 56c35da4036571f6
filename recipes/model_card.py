"""A model card (``README.md``) in every variant folder a recipe writes, so a folder uploaded to the
Hugging Face Hub, or handed to a colleague, says what it is: Hugging Face's YAML metadata header
(``base_model``, ``library_name``, ``tags``, ``quantized_by``, the quantization), how the variant was
made, its scores as the report has them, and how each runtime loads its files, or that it cannot.

The card is written after the report, beside the exports and inside none of them, so it counts in
no export's size and no variant's resume record (recipes/resume.py); a rerun writes it again.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from evalsuite.report import COLUMNS, Report, VariantRow, cells
from formats.hub import cached_repo, model_name
from formats.modelfile import modelfile_name
from formats.outputs import Outputs
from formats.registry import FORMATS
from recipes.schema import Recipe, Variant

CARD = "README.md"
_SCORE_COLUMNS = len(COLUMNS) - 1  # the report's columns but its time: the card describes files, not a run

# what each checkpoint folder needs beside transformers (None: the dense, dequantized one)
_TRANSFORMERS_EXTRA = {"safetensors": None, "compressed-tensors": "compressed-tensors", "gptq": "gptqmodel optimum",
                       "awq": "gptqmodel", "bitsandbytes": "bitsandbytes"}
# which folder a GGUF file is best made from: a quantized one first, whose int4 codes can survive into
# Q4_K (README, Commands), then the dense one
_CONVERT_FROM = ("compressed-tensors", "gptq", "awq", "bitsandbytes", "safetensors")
_NEAREST_GGUF = {2: "Q2_K", 3: "Q3_K_M", 4: "Q4_K_M", 5: "Q5_K_M", 6: "Q6_K"}  # other bits: Q8_0
FOLDER_EXPORTS = tuple(name for name, fmt in FORMATS.items() if fmt.folder)


def write_model_cards(report: Report, recipe: Recipe, model: Path, out_dir: Path) -> None:
    """Write ``<out>/<variant>/README.md`` for every variant of the recipe from ``report``'s rows;
    ``model`` is the source's path on disk (a cached snapshot's repository id is its base model)."""
    rows = {row.name: row for row in report.rows}
    with Outputs() as outputs:
        for variant in recipe.variants:
            text = model_card(variant, rows[variant.name], rows["original"], report, recipe, model)
            outputs.stage(out_dir / variant.name / CARD).write_text(text, encoding="utf-8")
        outputs.commit()


def model_card(variant: Variant, row: VariantRow, original: VariantRow, report: Report, recipe: Recipe,
               model: Path) -> str:
    """The card's text: a YAML header Hugging Face reads, then Markdown."""
    base = cached_repo(model) or model_name(model)
    files = _files(variant, row)
    folders = [e for e in FOLDER_EXPORTS if e in files]
    method = variant.weights.method
    tags = ["quantbench", "quantized", *([method] if method != "none" else []), *(e for e in files if e != "modelfile")]
    header = {
        "base_model": base,
        "base_model_relation": "quantized",
        **({"library_name": "transformers" if folders else "gguf"} if files else {}),
        "pipeline_tag": "text-generation",
        "tags": list(dict.fromkeys(tags)),  # a method and its export may share a name (gptq, awq)
        "quantized_by": "quantbench",
        "quantization": {"method": method, "scheme": row.method,
                         **{k: v for k, v in (("bits", getattr(variant.weights, "bits", None)),
                                              ("type", getattr(variant.weights, "type", None))) if v is not None},
                         "bits_per_weight": round(row.bits_per_weight, 3)},
    }
    head = list(COLUMNS[:_SCORE_COLUMNS])
    lines = [
        "---", yaml.safe_dump(header, sort_keys=False).rstrip(), "---", "",
        f"# {model_name(model)}: {variant.name}", "",
        f"`{base}` quantized by quantbench as {row.method}: "
        f"{row.bits_per_weight:.2f} bits per weight, {row.size_mb:.2f} MB.", "",
        "## How it was made", "",
        "The recipe's entry for this variant:", "", "```yaml",
        yaml.safe_dump(variant.model_dump(mode="json", exclude_none=True), sort_keys=False).rstrip(), "```", "",
        *_inputs(variant, report, recipe), "",
        "## Scores", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
        *("| " + " | ".join(cells(r)[:_SCORE_COLUMNS]) + " |" for r in (original, row)), "",
        "PPL: perplexity on the evaluation text. KLD: mean KL divergence from the original's next-token "
        "distribution (nats per token). top-1: share of positions where this variant's most likely next "
        "token is the original's. bpw: bits per weight over all tensors.", "",
        "## Loading it", "",
        *_loading(variant, files, folders),
    ]
    return "\n".join(lines) + "\n"


def _files(variant: Variant, row: VariantRow) -> dict[str, str]:
    """Export name -> its path relative to the variant folder (where the card is), from the report."""
    paths = [Path(f["path"]).relative_to(variant.name).as_posix() for f in row.files]
    found = {e: e for e in FOLDER_EXPORTS if e in paths}
    for path in paths:
        if path.endswith(".gguf"):  # its Ollama Modelfile is written beside it
            found.update(gguf=path, modelfile=modelfile_name(path))
    return found


def _inputs(variant: Variant, report: Report, recipe: Recipe) -> list[str]:
    """What the variant was scored, and fitted, on."""
    lines = [f"Scored against the original on {report.windows} windows of {report.window} tokens of "
             f"`{Path(report.eval_text).name}`."]
    if variant.needs_calibration and recipe.calibration is not None:
        cal = recipe.calibration
        lines.append(f"Fitted on at most {cal.max_windows} windows of {cal.window} tokens of `{cal.text.name}`.")
    if variant.kv_cache is not None:
        lines.append(f"Its KV cache ({variant.kv_cache.spec.label}) is a runtime setting, not stored in any file: "
                     "give it to the runtime (llama.cpp's `--cache-type-k`/`--cache-type-v`, vLLM's `--kv-cache-dtype`).")
    return [" ".join(lines)]


def _loading(variant: Variant, files: dict[str, str], folders: list[str]) -> list[str]:
    """Per runtime, the commands that load this variant's files, or why it cannot."""
    if not files:
        return ["This variant writes no model files (the recipe gives it no exports): it is a measurement only."]
    gguf = files.get("gguf")
    if not gguf:  # llama.cpp and Ollama need a GGUF file: made from a folder, at the GGUF type nearest the variant's bits
        source = next(e for e in _CONVERT_FROM if e in folders)
        file_type = _NEAREST_GGUF.get(getattr(variant.weights, "bits", None), "Q8_0")
        converted = f"{variant.name}-{file_type}.gguf"
        convert = (f"`quantize export` makes one from the {source} folder, quantized again to a GGUF type: "
                   f"`quantize export ./{source} --gguf {file_type} -o {converted}`")
    lines = ["### transformers", ""]
    if folders:
        for folder in folders:
            extra = _TRANSFORMERS_EXTRA[folder]
            lines += [f"`{folder}/`" + (f" (needs `pip install {extra}`)" if extra else
                                         " (dequantized weights: the variant's accuracy at the original's size)") + ":",
                      "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                      f'model = AutoModelForCausalLM.from_pretrained("{folder}")',
                      f'tokenizer = AutoTokenizer.from_pretrained("{folder}")', "```", ""]
    else:
        lines += [f"transformers cannot load this variant as it is stored: its only weights are the GGUF file "
                  f"`{gguf}` (transformers' `gguf_file=` would dequantize it to float).", ""]
    lines += ["### vLLM", ""]
    if folders:
        lines += ["```", *(f"vllm serve ./{folder}" for folder in folders), "```", ""]
        if "safetensors" in folders:
            lines += ["`./safetensors` holds the dequantized weights: it runs at the original's size and speed.", ""]
    else:
        lines += [f"vLLM cannot load this variant: it loads checkpoint folders, and this variant has only the GGUF "
                  f"file `{gguf}` (use llama.cpp or Ollama).", ""]
    lines += ["### llama.cpp", ""]
    if gguf:
        lines += ["```", f'llama-cli -m {gguf} -p "Once upon a time"', f"llama-server -m {gguf} --port 8080", "```", ""]
    else:
        lines += [f"llama.cpp cannot load this variant: it reads GGUF files, and this variant has none; {convert}.", ""]
    lines += ["### Ollama", ""]
    if gguf:
        lines += ["```", f"ollama create {variant.name} -f {files['modelfile']}", f"ollama run {variant.name}", "```"]
    else:
        lines += [f"Ollama cannot load this variant without conversion: it has no GGUF file; {convert}, then "
                  f"`ollama create {variant.name} -f {modelfile_name(converted)}` (export writes that Modelfile beside it)."]
    return lines
