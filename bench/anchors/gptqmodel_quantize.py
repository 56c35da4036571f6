"""GPTQModel anchor: quantize an HF causal LM with GPTQModel's GPTQ on fixed windows.

Runs INSIDE the anchor venv made by ``bench/anchors/setup.sh gptqmodel``::

    .anchors/gptqmodel/bin/python bench/anchors/gptqmodel_quantize.py \
        --model DIR --windows WINDOWS.safetensors --bits 4 --group-size 128 \
        [--act-order] [--damp 0.01] --out OUT_DIR

WINDOWS.safetensors holds one int64 tensor ``input_ids`` [N, L]: calibration
windows already tokenized, used as-is (attention mask all ones, no re-sorting,
no concatenation, no truncation).

Writes:
  OUT_DIR/gptq/        GPTQModel's own checkpoint (GPTQ format, as it saves it)
  OUT_DIR/dense/       plain HF folder: Linear weights = the dequantized weights
                       of that checkpoint (unpacked from qweight/qzeros/scales/
                       g_idx), every other tensor unchanged; loads with
                       transformers.AutoModelForCausalLM.from_pretrained
  OUT_DIR/anchor.json  settings, timings, peak RSS, verification numbers

The dense weights are float32 by default: (q - z) * scale with an fp16 scale is
exact in float32 but not in bf16.  ``--dense-dtype model`` keeps the model's
dtype instead (bf16 for the shared models; rounding error ~2^-9 relative).

What GPTQModel 7.6.0 does here (see anchor.json "gptqmodel_settings"):
  - loads the model in bf16 on CPU and runs the calibration forwards in bf16;
    Hessians are accumulated in float32 from those bf16 activations;
  - true_sequential=True: each decoder layer is replayed once per module subset
    (qkv, o, gate/up, down) plus once after quantization, batch_size windows
    per forward (default 1; a different batch size changes results at noise
    level because the bf16 activations differ slightly);
  - act_group_aware (GAR, a group-aware column reordering) is ON by default
    when desc_act is off; --act-group-aware off gives textbook GPTQ;
  - static_groups=False, mse=0 (plain absmax scale), sym zero-point 2^(b-1),
    block size 128; damp_percent is raised in steps of damp_auto_increment
    only when a Cholesky fails (reported in damp_raised_modules).

Only safetensors/json are read (no pickle).  Exit status 2 with a one-line
message for a missing/invalid model folder or windows file.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import common

# GPTQModel sizes its CPU thread pool from this at import time.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LOGBAR_ANIMATION", "0")  # fewer progress-bar redraws in captured logs

TOOL = "gptqmodel_quantize"


def die(msg: str, code: int = 2) -> None:
    common.die(TOOL, msg, code)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--windows", required=True, help="safetensors file with int64 input_ids [N, L]")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 8])
    p.add_argument("--group-size", type=int, default=128, help="-1 for one group per row")
    p.add_argument("--act-order", action="store_true", help="GPTQ desc_act (activation order)")
    p.add_argument("--damp", type=float, default=0.01, help="damp_percent (GPTQModel default is 0.05)")
    p.add_argument(
        "--act-group-aware",
        choices=["auto", "on", "off"],
        default="auto",
        help="GPTQModel's group-aware reordering (GAR). auto = GPTQModel's default: "
        "on when --act-order is off, off with --act-order. 'off' gives textbook GPTQ.",
    )
    p.add_argument("--batch-size", type=int, default=1, help="calibration forward batch (GPTQModel default 1)")
    p.add_argument("--dense-dtype", choices=["float32", "model"], default="float32")
    p.add_argument("--verify-windows", type=int, default=4,
                   help="windows used to compare GPTQModel's forward with transformers on dense/ (0: skip)")
    p.add_argument("--out", required=True, help="output folder")
    return p.parse_args(argv)


def check_inputs(args: argparse.Namespace):
    model = Path(args.model)
    common.check_model_dir(TOOL, model)
    if args.group_size != -1 and args.group_size <= 0:
        die(f"--group-size must be -1 or positive, got {args.group_size}")
    if args.act_order and args.act_group_aware == "on":
        die("--act-group-aware on cannot be combined with --act-order (GPTQModel refuses both)")
    if args.batch_size < 1:
        die(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (0.0 < args.damp < 1.0):
        die(f"--damp must be in (0, 1), got {args.damp}")

    ids = common.load_windows(TOOL, Path(args.windows), model)
    return model, ids


# --------------------------------------------------------------------------- #
# safetensors helpers
# --------------------------------------------------------------------------- #
def read_safetensors_dir(folder: Path) -> dict:
    """All tensors of a folder (single file or shards), safetensors only."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    out = {}
    for name in files:
        out.update(load_file(str(folder / name), device="cpu"))
    return out


# --------------------------------------------------------------------------- #
# GPTQ unpacking (independent of GPTQModel's kernels)
# --------------------------------------------------------------------------- #
def unpack_bitstream(packed, bits: int, count: int, dim: int):
    """Unpack int32 words holding `bits`-bit codes as one little-endian bit stream
    along `dim` (low bits first; 3-bit codes straddle words).  Returns int64 codes
    with `count` entries along `dim`."""
    import torch

    words = packed.to(torch.int64) & 0xFFFFFFFF  # unsigned view of each int32 word
    if dim == 1:
        words = words.t()
    n_words = words.shape[0]
    idx = torch.arange(count, dtype=torch.int64)
    bit = idx * bits
    w0 = bit // 32
    sh = bit % 32
    w1 = torch.clamp(w0 + 1, max=n_words - 1)
    lo = words[w0] >> sh.unsqueeze(1)
    hi = (words[w1] << (32 - sh).unsqueeze(1)) & 0xFFFFFFFF
    straddle = (sh + bits > 32).unsqueeze(1)
    vals = torch.where(straddle, lo | hi, lo) & ((1 << bits) - 1)
    if dim == 1:
        vals = vals.t()
    return vals.contiguous()


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int, zero_offset: int):
    """Dense weight [out, in] in float32 from GPTQ tensors.

    qweight [I*b/32, O] packed along in-dim; qzeros [G, O*b/32] packed along out-dim;
    scales [G, O]; g_idx [I].  zero_offset = 1 for the v1 ('gptq') layout, which
    stores zero-points minus one; 0 for v2.
    """
    import torch

    out_features = scales.shape[1]
    in_features = g_idx.shape[0]
    q = unpack_bitstream(qweight, bits, in_features, dim=0)            # [I, O]
    z = unpack_bitstream(qzeros, bits, out_features, dim=1)            # [G, O]
    z = (z + zero_offset) & ((1 << bits) - 1) if zero_offset else z
    g = g_idx.to(torch.int64)
    s = scales.to(torch.float32)
    w = (q - z[g]).to(torch.float32) * s[g]                             # [I, O]
    return w.t().contiguous()


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir, windows = check_inputs(args)
    model_dir = model_dir.resolve()
    out = Path(args.out).resolve()
    gptq_dir, dense_dir = out / "gptq", out / "dense"
    out.mkdir(parents=True, exist_ok=True)
    for d in (gptq_dir, dense_dir):
        if d.exists():
            shutil.rmtree(d)

    # GPTQModel writes per-run logs to ./logs/ (relative to the working directory):
    # keep them in OUT_DIR/logs instead of the caller's tree.
    os.chdir(out)

    import torch

    n_win, win_len = (int(x) for x in windows.shape)
    torch.manual_seed(0)

    import gptqmodel
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import GPTQConfig

    aga = {"auto": None, "on": True, "off": False}[args.act_group_aware]
    qcfg = GPTQConfig(
        bits=args.bits,
        group_size=args.group_size,
        sym=True,
        desc_act=bool(args.act_order),
        act_group_aware=aga,
        damp_percent=args.damp,
        lm_head=False,
        device="cpu",
    )

    # ---------------- quantization (timed) ----------------
    load_t0 = time.perf_counter()
    # QuantizeConfig.device="cpu" already places it; load() refuses device= as well.
    model = GPTQModel.load(str(model_dir), quantize_config=qcfg)
    load_s = time.perf_counter() - load_t0
    calib = [{"input_ids": row.clone(), "attention_mask": torch.ones_like(row)} for row in windows]
    rss_before = common.peak_rss_mb()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    model.quantize(
        calib,
        batch_size=args.batch_size,
        calibration_sort=None,             # keep the given order (all windows have equal length)
        calibration_data_min_length=0,     # never drop a window
    )
    seconds = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_seconds = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    rss_quant = common.peak_rss_mb()

    resolved = {
        "damp_percent": qcfg.damp_percent,
        "damp_auto_increment": qcfg.damp_auto_increment,
        "desc_act": qcfg.desc_act,
        "act_group_aware": qcfg.act_group_aware,
        "true_sequential": qcfg.true_sequential,
        "static_groups": qcfg.static_groups,
        "mse": qcfg.mse,
        "sym": qcfg.sym,
        "offload_to_disk": qcfg.offload_to_disk,
        "fallback": str(getattr(qcfg.fallback, "strategy", None)),
        "fallback_threshold": str(getattr(qcfg.fallback, "threshold", None)),
        "batch_size": args.batch_size,
    }
    # per-module damp actually used / loss, when GPTQModel exposes its log
    quant_log = None
    try:
        ql = getattr(model, "quant_log", None)
        if ql:
            quant_log = [{k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                          for k, v in row.items()} for row in ql]
    except Exception:
        quant_log = None

    damps = []
    for row in quant_log or []:
        try:
            damps.append((f"{row.get('layer')}.{row.get('module')}", float(row.get("damp"))))
        except (TypeError, ValueError):
            pass
    damp_raised = [name for name, d in damps if d > args.damp + 1e-9]
    try:
        calib_dtype = str(next(model.model.parameters()).dtype).replace("torch.", "")
    except Exception:
        calib_dtype = None

    model.save(str(gptq_dir))
    del model
    import gc
    gc.collect()

    # ---------------- dense export from the saved checkpoint ----------------
    dense_info = export_dense(gptq_dir, model_dir, dense_dir, args.dense_dtype)

    # ---------------- verification against GPTQModel's own runtime ----------------
    verify = {}
    if args.verify_windows > 0:
        verify = verify_against_gptqmodel(gptq_dir, dense_dir, windows[: args.verify_windows])

    info = {
        "tool": "gptqmodel",
        "version": gptqmodel.__version__,
        "bits": args.bits,
        "group_size": args.group_size,
        "act_order": bool(args.act_order),
        "damp": args.damp,
        "windows": [n_win, win_len],
        "seconds": round(seconds, 3),
        "peak_rss_mb": round(rss_quant, 1),
        "dense_dtype": dense_info["dense_dtype"],
        "cpu_seconds": round(cpu_seconds, 3),   # user+sys of all threads during quantize()
        "model": str(model_dir.resolve()),
        "model_dtype": dense_info["model_dtype"],
        "load_seconds": round(load_s, 3),
        "peak_rss_mb_before_quantize": round(rss_before, 1),
        "peak_rss_mb_end": round(common.peak_rss_mb(), 1),
        "cpu_workers": int(os.environ["GPTQMODEL_CPU_WORKERS"]),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "gptqmodel": gptqmodel.__version__,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "gptqmodel_settings": resolved,
        "calibration_forward_dtype": calib_dtype,
        "damp_max_used": max((d for _, d in damps), default=None),
        "damp_raised_modules": damp_raised,
        **{k: v for k, v in dense_info.items() if k not in ("dense_dtype", "model_dtype")},
        "verify": verify,
        "quant_log": quant_log,
    }
    (out / "anchor.json").write_text(json.dumps(info, indent=2) + "\n")
    summary = {k: info[k] for k in ("tool", "version", "bits", "group_size", "act_order", "damp", "windows",
                                    "seconds", "cpu_seconds", "peak_rss_mb", "dense_dtype")}
    summary["verify"] = verify
    print("ANCHOR " + json.dumps(summary))
    return 0


def export_dense(gptq_dir: Path, model_dir: Path, dense_dir: Path, dense_dtype_opt: str) -> dict:
    """Write dense_dir from GPTQModel's saved checkpoint: every quantized Linear's
    weight replaced by its dequantized value, all other tensors from model_dir."""
    import torch
    from safetensors.torch import save_file

    qcfg_saved = json.loads((gptq_dir / "quantize_config.json").read_text())
    fmt = str(qcfg_saved.get("checkpoint_format") or qcfg_saved.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        die(f"unexpected checkpoint_format {fmt!r} in {gptq_dir}", code=1)
    if str(qcfg_saved.get("pack_dtype", "int32")) != "int32":
        die(f"unsupported pack_dtype {qcfg_saved.get('pack_dtype')!r} in {gptq_dir}", code=1)
    zero_offset = 1 if fmt == "gptq" else 0   # v1 stores zero-point - 1
    bits = int(qcfg_saved["bits"])

    qstate = read_safetensors_dir(gptq_dir)
    orig = read_safetensors_dir(model_dir)
    orig_cfg = json.loads((model_dir / "config.json").read_text())
    model_dtype_name = str(orig_cfg.get("dtype") or orig_cfg.get("torch_dtype") or "float32")
    dense_dtype = torch.float32 if dense_dtype_opt == "float32" else getattr(torch, model_dtype_name)
    dense_dtype_name = str(dense_dtype).replace("torch.", "")

    prefixes = sorted(k[: -len(".qweight")] for k in qstate if k.endswith(".qweight"))
    if not prefixes:
        die(f"no quantized modules (qweight) in {gptq_dir}", code=1)
    dense = {}
    for p in prefixes:
        wkey = p + ".weight"
        if wkey not in orig:
            die(f"quantized module {p} has no {wkey} in the original model", code=1)
        w = dequantize_gptq(qstate[p + ".qweight"], qstate[p + ".qzeros"], qstate[p + ".scales"],
                            qstate[p + ".g_idx"], bits, zero_offset)
        if tuple(w.shape) != tuple(orig[wkey].shape):
            die(f"{p}: dequantized shape {tuple(w.shape)} != original {tuple(orig[wkey].shape)}", code=1)
        dense[wkey] = w.to(dense_dtype)
    qsuffixes = (".qweight", ".qzeros", ".scales", ".g_idx")
    changed = []
    for k, v in orig.items():
        if k in dense:
            continue
        dense[k] = v.to(dense_dtype) if v.is_floating_point() else v
        sv = qstate.get(k)
        if sv is not None and not torch.equal(sv.to(v.dtype), v):
            changed.append(k)
    missing = [k for k in orig if k not in dense]
    extra = [k for k in qstate if not k.endswith(qsuffixes) and k not in orig]
    if missing:
        die(f"dense export lost tensors: {missing[:5]}", code=1)

    dense_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(dense_dir / "model.safetensors"),
              metadata={"format": "pt"})
    os.chmod(dense_dir / "model.safetensors", 0o644)
    cfg = dict(orig_cfg)
    cfg.pop("quantization_config", None)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = dense_dtype_name
    (dense_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    common.copy_tokenizer_files(model_dir, dense_dir)
    return {
        "dense_dtype": dense_dtype_name,
        "model_dtype": model_dtype_name,
        "checkpoint_format": fmt,
        "quantized_modules": len(prefixes),
        "nonquant_tensors_identical_to_original": not changed,
        "nonquant_tensors_changed": changed[:20],
        "extra_tensors_in_checkpoint": extra[:20],
    }


def verify_against_gptqmodel(gptq_dir: Path, dense_dir: Path, windows) -> dict:
    """Check dense/ against GPTQModel's own runtime on its checkpoint.

    GPTQModel's CPU kernel (TorchLinear) runs only in float16/bfloat16: it
    computes scales[g] * (q - z) in the model dtype, then matmuls in that dtype.
    For each of the two dtypes we load the checkpoint with GPTQModel and report
      - weights: its modules' dequantize_weight() vs our float32 unpacking
        (max abs diff, and whether it equals ours rounded to that dtype);
      - logits: GPTQModel's forward vs transformers on dense/ loaded in the same
        dtype, and vs transformers on dense/ in float32.
    """
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dense = load_file(str(dense_dir / "model.safetensors"))
    ref32 = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    res = {"windows": [int(windows.shape[0]), int(windows.shape[1])]}
    with torch.no_grad():
        logits32 = [ref32(input_ids=r.unsqueeze(0)).logits.float() for r in windows]
    del ref32

    def nll(logits_list):
        tot, n = 0.0, 0
        for lg, r in zip(logits_list, windows):
            tot += float(torch.nn.functional.cross_entropy(lg[0, :-1], r[1:], reduction="sum"))
            n += r.numel() - 1
        return tot / n

    res["nll_dense_float32"] = nll(logits32)
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        qm = GPTQModel.load(str(gptq_dir), device="cpu", backend=BACKEND.TORCH, dtype=dtype)
        inner = qm.model.eval()
        mods = dict(inner.named_modules())
        wmax, weq, checked, kernels, scale_dtypes = 0.0, 0, 0, set(), set()
        for prefix, m in mods.items():
            if not hasattr(m, "qweight") or not hasattr(m, "dequantize_weight"):
                continue
            kernels.add(type(m).__name__)
            scale_dtypes.add(str(m.scales.dtype).replace("torch.", ""))
            with torch.no_grad():
                wq = m.dequantize_weight().t()          # GPTQModel returns [in, out]
            ours = dense[prefix + ".weight"]
            wmax = max(wmax, float((wq.float() - ours.float()).abs().max()))
            weq += int(torch.equal(wq.to(dtype), ours.to(dtype)))
            checked += 1
        hf = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=dtype).eval()
        d_same, d_32, lq_all = 0.0, 0.0, []
        with torch.no_grad():
            for r, l32 in zip(windows, logits32):
                ids = r.unsqueeze(0)
                lq = inner(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
                lh = hf(input_ids=ids).logits.float()
                d_same = max(d_same, float((lq - lh).abs().max()))
                d_32 = max(d_32, float((lq - l32).abs().max()))
                lq_all.append(lq)
        res[name] = {
            "kernel": sorted(kernels),
            "scales_dtype_at_runtime": sorted(scale_dtypes),
            "modules": checked,
            "weight_max_abs_diff_vs_ours_f32": wmax,
            "modules_bit_equal_to_ours_rounded": weq,
            "logits_max_abs_diff_vs_transformers_dense_same_dtype": d_same,
            "logits_max_abs_diff_vs_transformers_dense_f32": d_32,
            "nll_gptqmodel": nll(lq_all),
        }
        del qm, inner, hf, mods
    res["logits_max_abs_f32"] = max(float(l.abs().max()) for l in logits32)
    return res


if __name__ == "__main__":
    # an offline run, as a script only: importing this module leaves the process as it was
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sys.exit(main())
