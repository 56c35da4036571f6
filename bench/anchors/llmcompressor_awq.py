"""Anchor runner: llm-compressor's AWQ (W<bits> group-<g> asymmetric) on given windows.

Runs INSIDE the anchor venv made by ``bench/anchors/setup.sh llmcompressor``
(llmcompressor 0.14 / compressed-tensors 0.19 / transformers 5.17, which must
not share a venv with quantbench's own stack)::

    .anchors/llmcompressor/bin/python bench/anchors/llmcompressor_awq.py \
        --model DIR --windows WINDOWS.safetensors --bits 4 --group-size 128 --out OUT

WINDOWS.safetensors holds one int64 tensor ``input_ids`` [N, L]: the calibration
windows, already tokenized. They are used as-is (attention mask all ones, no
shuffling, no truncation, no BOS added), so llm-compressor sees exactly the
windows our own AWQ sees.

Recipe: ``AWQModifier()`` with llm-compressor's defaults (mappings from its
registry for the architecture, duo_scaling=True, n_grid=20) followed by
``QuantizationModifier`` with the int, group-wise, asymmetric weight-only scheme
(= its "W4A16_ASYM" preset for 4 bits / group 128), targets Linear, lm_head
ignored; weight ranges by min-max (llm-compressor's AWQ has no clipping search).
The model is loaded in float32 by default (``--dtype``), like quantbench's own
methods; ``--dtype auto`` is what llm-compressor's examples do.

Writes
  OUT/compressed/   compressed-tensors checkpoint (pack-quantized), as oneshot saves it
  OUT/dense/        plain HF folder: the compressed checkpoint dequantized with
                    compressed-tensors (Linear weights = (q - z) * s; every other
                    tensor, incl. the norms AWQ rescaled, taken from the checkpoint),
                    config.json without quantization_config, tokenizer files copied
                    from --model. Loads with plain transformers, no compressed-tensors.
  OUT/anchor.json   tool, version, bits, group_size, symmetric, windows [N, L],
                    seconds (wall time of oneshot), peak_rss_mb (process peak RSS
                    when oneshot returned), dense_dtype, plus the AWQ settings and
                    the logits check (compressed vs dense).

Exit status 2, with a one-line message on stderr, for a missing model folder or
windows file or a malformed windows file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import common

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOOL = "llmcompressor_awq"


def die(msg: str, code: int = 2) -> None:
    common.die(TOOL, msg, code)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (Llama/Qwen2, with tokenizer)")
    p.add_argument("--windows", required=True, help="safetensors file with int64 input_ids [N, L]")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--batch-size", type=int, default=8,
                   help="calibration batch size (llm-compressor's own default is 1). All "
                        "windows have length L, so no padding or truncation happens and the "
                        "batch size changes nothing but float summation order; 8 runs about "
                        "1.5x faster than 1 on CPU")
    p.add_argument("--dtype", choices=("float32", "auto", "bfloat16", "float16"), default="float32",
                   help="dtype the model is loaded in for oneshot; weight scales and dense/ get "
                        "it too. Default float32, the precision quantbench's own methods work "
                        "in; 'auto' (the checkpoint's dtype, bf16 for the shared models) is what "
                        "llm-compressor's examples do, but bf16 matmuls are ~3x slower than "
                        "fp32 on a CPU without avx512_bf16")
    p.add_argument("--check-windows", type=int, default=2,
                   help="windows used for the compressed-vs-dense logits check (0 = skip)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    return p.parse_args(argv)


def patch_pin_memory_for_cpu() -> None:
    """Workaround (llmcompressor 0.14): AWQModifier._apply_smoothing calls
    IntermediatesCache.pin_memory() on every cached batch before its grid search,
    to speed host->GPU copies. Pinning needs an accelerator; on a CPU-only torch it
    raises. Pinning changes no values, only transfer speed, so without an
    accelerator we make it a no-op."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        return

    def _no_pin(self, batch_index, input_names=None):  # noqa: ARG001
        return None

    IntermediatesCache.pin_memory = _no_pin


def scale_dtype_of(ckpt: Path):
    """dtype of the weight scales stored in a compressed-tensors checkpoint."""
    from safetensors import safe_open

    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith(".weight_scale"):
                    return sf.get_tensor(k).dtype
    raise RuntimeError(f"no weight_scale tensor in {ckpt}")


RESOLVED_MAPPINGS: list[dict] = []


def record_resolved_mappings() -> None:
    """Instrumentation only: remember which (smooth -> balance) pairs AWQ really
    used (it silently skips e.g. v_proj -> o_proj when GQA makes shapes differ)."""
    from llmcompressor.modifiers.transform.awq import AWQModifier

    orig = AWQModifier._set_resolved_mappings

    def wrapped(self, model):
        orig(self, model)
        RESOLVED_MAPPINGS[:] = [
            {"smooth": m.smooth_name, "balance": list(m.balance_names), "parent": m.parent_name}
            for m in self._resolved_mappings
        ]

    AWQModifier._set_resolved_mappings = wrapped


def make_dense(compressed: Path, dense: Path, model_dir: Path) -> str:
    """Dequantize the compressed-tensors checkpoint with compressed-tensors' own
    model-free converter; returns the dense dtype name."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer

    dtype = scale_dtype_of(compressed)  # dequantize() yields scale dtype; keep it
    if dense.exists():
        shutil.rmtree(dense)
    convert_checkpoint(
        model_stub=str(compressed),
        save_directory=str(dense),
        converter=CompressedTensorsDequantizer(str(compressed), dtype=dtype),
        device="cpu",
    )
    # A plain HF folder: no quantization_config, no llm-compressor recipe.
    cfg_path = dense / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("recipe.yaml",):
        if (dense / extra).exists():
            (dense / extra).unlink()
    # convert_checkpoint always writes an index; a single-file checkpoint needs none
    index = dense / "model.safetensors.index.json"
    if index.exists() and set(json.loads(index.read_text())["weight_map"].values()) == {
        "model.safetensors"
    }:
        index.unlink()
    common.copy_tokenizer_files(model_dir, dense)
    # sanity: no quantization params may be left
    from safetensors import safe_open

    for f in sorted(dense.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            bad = [k for k in sf.keys() if not (k.endswith(".weight") or k.endswith(".bias"))]
            if bad:
                raise RuntimeError(f"dense checkpoint still holds non-weight tensors: {bad[:5]}")
    return str(dtype).replace("torch.", "")


def logits_check(compressed: Path, dense: Path, ids) -> dict:
    """Logits of the compressed checkpoint as transformers + compressed-tensors
    run it, vs logits of dense/ loaded as a plain model."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    with torch.inference_mode():
        mc = AutoModelForCausalLM.from_pretrained(str(compressed), dtype="auto")
        mc.eval()
        lc = mc(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
        out["compressed_weight_dtype"] = str(next(mc.parameters()).dtype).replace("torch.", "")
        del mc
        md = AutoModelForCausalLM.from_pretrained(str(dense), dtype="auto")
        md.eval()
        ld = md(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
        del md
    diff = (lc - ld).abs()
    out["windows"] = int(ids.shape[0])
    out["max_abs_diff"] = float(diff.max())
    out["mean_abs_diff"] = float(diff.mean())
    out["max_abs_logit"] = float(lc.abs().max())
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.model)
    windows_path = Path(args.windows)
    out_dir = Path(args.out)
    common.check_model_dir(TOOL, model_dir)
    if args.bits < 1 or args.bits > 8:
        die(f"--bits must be in 1..8, got {args.bits}")
    if args.group_size < 1:
        die(f"--group-size must be positive, got {args.group_size}")

    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ids = common.load_windows(TOOL, windows_path, model_dir)
    n, seq_len = map(int, ids.shape)

    import compressed_tensors
    import llmcompressor
    import transformers
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    patch_pin_memory_for_cpu()
    record_resolved_mappings()

    out_dir.mkdir(parents=True, exist_ok=True)
    compressed_dir = out_dir / "compressed"
    dense_dir = out_dir / "dense"

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model_dtype = str(model.dtype).replace("torch.", "")

    # llm-compressor's standard asymmetric int weight-only scheme. For bits=4,
    # group 128 this is exactly its "W4A16_ASYM" preset (asserted below).
    weights = QuantizationArgs(
        num_bits=args.bits,
        type=QuantizationType.INT,
        strategy=QuantizationStrategy.GROUP,
        group_size=args.group_size,
        symmetric=False,
        dynamic=False,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    if args.bits == 4 and args.group_size == 128:
        preset = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
        assert preset.weights == weights and preset.input_activations is None, preset

    awq = AWQModifier()  # defaults: mappings from the model's registry, duo_scaling=True, n_grid=20
    recipe = [
        awq,
        QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]),
    ]

    # Exactly the given windows: pre-tokenized dataset (llm-compressor then skips
    # its own tokenization), all N used (no shuffling; its length-aware sampler only
    # reorders, and all windows have length L), no truncation (max_seq_length=L).
    ds = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )

    t0 = time.perf_counter()
    model = oneshot(
        model=model,
        processor=tokenizer,
        recipe=recipe,
        dataset=ds,
        num_calibration_samples=n,
        shuffle_calibration_samples=False,
        max_seq_length=seq_len,
        batch_size=args.batch_size,
    )
    seconds = time.perf_counter() - t0
    rss_oneshot = common.peak_rss_mb()
    print(f"[anchor] oneshot done: {seconds:.1f} s, peak RSS {rss_oneshot:.0f} MB", flush=True)

    if compressed_dir.exists():
        shutil.rmtree(compressed_dir)
    model.save_pretrained(str(compressed_dir), save_compressed=True)
    tokenizer.save_pretrained(str(compressed_dir))
    common.copy_tokenizer_files(model_dir, compressed_dir)
    if (model_dir / "generation_config.json").is_file() and not (
        compressed_dir / "generation_config.json"
    ).is_file():
        shutil.copyfile(model_dir / "generation_config.json", compressed_dir / "generation_config.json")
    del model

    dense_dtype = make_dense(compressed_dir, dense_dir, model_dir)

    check = None
    if args.check_windows > 0:
        check = logits_check(compressed_dir, dense_dir, ids[: args.check_windows])
        print(f"[anchor] logits compressed vs dense on {check['windows']} windows: "
              f"max abs diff {check['max_abs_diff']:.3g} "
              f"(max |logit| {check['max_abs_logit']:.3g})", flush=True)

    info = {
        "tool": TOOL,
        "version": llmcompressor.__version__,
        "bits": args.bits,
        "group_size": args.group_size,
        "symmetric": False,
        "windows": [n, seq_len],
        "seconds": round(seconds, 3),
        "peak_rss_mb": round(rss_oneshot, 1),
        "dense_dtype": dense_dtype,
        # extras (informative; the benchmark relies only on the keys above)
        "versions": {
            "llmcompressor": llmcompressor.__version__,
            "compressed_tensors": compressed_tensors.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "model_dtype": model_dtype,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "awq": {
            "duo_scaling": awq.duo_scaling,
            "n_grid": awq.n_grid,
            "mappings": [
                {"smooth_layer": m.smooth_layer, "balance_layers": list(m.balance_layers)}
                for m in (awq.mappings or [])
            ],
            "resolved_mappings": RESOLVED_MAPPINGS,
            "ignore": ["lm_head"],
            "weight_observer": "memoryless_minmax (no clipping search)",
        },
        "peak_rss_mb_total": round(common.peak_rss_mb(), 1),
        "logits_check": check,
    }
    (out_dir / "anchor.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"[anchor] wrote {out_dir / 'anchor.json'}", flush=True)
    return 0


if __name__ == "__main__":
    # an offline run, as a script only: importing this module leaves the process as it was
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    raise SystemExit(main())
