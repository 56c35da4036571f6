"""Post-training quantization methods side by side on one model: accuracy, time and memory.

    python bench/ptq_table.py --model DIR --calib FILE --eval FILE [--json]
        [--bits 4 3] [--group-size 128] [--calib-windows 128] [--window 512] [--seed 0]
        [--eval-windows N] [--methods rtn rtn-mse gptq gptq-actorder rtn-asym awq smoothquant-w8a8
                                      gptqmodel llmcompressor-awq]
        [--work DIR]

Every method quantizes the decoder's Linear weights (the output head is left alone) from the
same calibration windows: ``--calib-windows`` windows of ``--window`` tokens drawn with ``--seed`` from
the calibration text, written once to a safetensors file that the anchors read too. Each method
runs in its own process, so its time and peak RSS are its own, and leaves a dense float model that
this process then scores against the unquantized one on the evaluation text (consecutive
512-token windows): perplexity, its increase, KL divergence and top-1 agreement.
``smoothquant-w8a8`` (SmoothQuant α 0.5, int8 per-channel weights, int8 per-token activations) is
scored with its activation quantization simulated on the Linear inputs the worker names. With ``--work DIR``
the windows and every method's output stay in DIR, and a method whose output is already there (same
windows) is scored without being run again, so a long table can be built over several runs.

Anchors are the maintained tools users would otherwise pick, each in its own virtualenv
(``bench/anchors/setup.sh NAME``): ``gptqmodel`` (GPTQModel 7.6.0's GPTQ, same bits, group size,
symmetric, no act-order, damping 0.01) and ``llmcompressor-awq`` (llm-compressor's AWQ,
asymmetric). An anchor whose virtualenv is missing is skipped with a note.

Prints one table; with ``--json``, a JSON list of rows on stdout instead, each with ``method``,
``bits``, ``group_size``, ``symmetric``, ``ppl``, ``ppl_delta``, ``kld``, ``top1``, ``seconds``,
``peak_rss_mb`` (the unquantized model is the row with method ``none``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OURS = ("rtn", "rtn-mse", "gptq", "gptq-actorder", "rtn-asym", "awq", "smoothquant-w8a8")
# Weight-and-activation methods: run once, at 8 bits per channel, whatever --bits says.
W8A8 = ("smoothquant-w8a8",)
ANCHORS = {  # method -> (virtualenv, script, extra arguments)
    # GPTQModel's group-aware reordering off: textbook GPTQ, the same algorithm as our 'gptq' row
    # (with it on, its default, perplexity came out higher on this model: see docs/ptq.md).
    "gptqmodel": ("gptqmodel", "gptqmodel_quantize.py", ["--act-group-aware", "off"]),
    "llmcompressor-awq": ("llmcompressor", "llmcompressor_awq.py", []),
}
SYMMETRIC = {"rtn-asym": False, "awq": False, "llmcompressor-awq": False}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser, calib_windows=128, eval_windows=None)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=[*OURS, *ANCHORS], choices=[*OURS, *ANCHORS])
    parser.add_argument("--work", type=Path, default=None, help="keep windows and outputs here; reuse finished methods")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    from evalsuite.metrics import causal_lm_logprobs, score
    from formats.hf import load_causal_lm

    ckpt, calib, evaluation = open_windows(args)
    work = args.work or Path(tempfile.mkdtemp(prefix="ptq_table_"))
    work.mkdir(parents=True, exist_ok=True)
    windows_file = work / "windows.safetensors"
    if windows_file.exists() and not torch.equal(load_file(str(windows_file))["input_ids"], calib):
        sys.exit(f"error: {windows_file} holds other calibration windows: use a fresh --work folder")
    save_file({"input_ids": calib.contiguous()}, str(windows_file))
    log(f"calibration: {len(calib)} windows of {args.window} tokens (seed {args.seed}); evaluation: {len(evaluation)} windows of 512")

    original = load_causal_lm(ckpt)
    reference = causal_lm_logprobs(original)
    base = score(reference, evaluation)
    rows = [dict(method="none", bits=16, group_size=None, symmetric=None, ppl=base.ppl, ppl_delta=0.0, kld=0.0,
                 top1=1.0, seconds=None, peak_rss_mb=None)]
    runs = [(bits, m) for bits in args.bits for m in args.methods if m not in W8A8]
    runs += [(8, m) for m in args.methods if m in W8A8]
    for bits, method in runs:
        out = work / f"{method}-w{bits}"
        run = run_method(method, bits, args, windows_file, out)
        if run is None:
            continue
        model = load_dense(out / "dense")
        with activation_simulation(model, run.get("activations")):
            s = score(causal_lm_logprobs(model), evaluation, reference)
        group_size = None if method in W8A8 else args.group_size
        rows.append(dict(method=method, bits=bits, group_size=group_size, symmetric=SYMMETRIC.get(method, True),
                         ppl=s.ppl, ppl_delta=s.ppl - base.ppl, kld=s.kld, top1=s.top1,
                         seconds=run["seconds"], peak_rss_mb=run["peak_rss_mb"]))
        log(f"{method} w{bits}: ppl {s.ppl:.3f} ({s.ppl - base.ppl:+.3f}), kld {s.kld:.4f}, {run['seconds']:.1f} s, {run['peak_rss_mb']:.0f} MiB")
        del model
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, args)


def add_window_arguments(parser: argparse.ArgumentParser, calib_windows: int, eval_windows: int | None,
                         texts: tuple[Path, Path] | None = None, model: bool = True) -> None:
    """The model (unless the table takes several its own way), its texts (required unless
    ``texts`` gives the calibration and evaluation defaults) and the windows drawn from them, as
    every table of methods takes them."""
    if model:
        parser.add_argument("--model", type=Path, required=True)
    for flag, default in zip(("--calib", "--eval"), texts or (None, None)):
        parser.add_argument(flag, type=Path, required=default is None, default=default)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calib-windows", type=int, default=calib_windows)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=eval_windows)


def open_windows(args):
    """The checkpoint, ``--calib-windows`` windows of ``--window`` tokens drawn with ``--seed``
    from the calibration text, and consecutive 512-token windows of the evaluation text; a bad
    path or text exits with its one-line error."""
    from calib.text import sample_windows, token_windows
    from formats.hf import HFCheckpoint, load_tokenizer
    from core.errors import InputError

    try:
        ckpt = HFCheckpoint.open(args.model)
        tokenizer = load_tokenizer(ckpt)
        calib = sample_windows(tokenizer, args.calib, args.window, args.calib_windows, args.seed)
        evaluation = token_windows(tokenizer, args.eval, 512, args.eval_windows)
    except InputError as e:
        sys.exit(f"error: {e}")
    return ckpt, calib, evaluation


def run_method(method: str, bits: int, args, windows_file: Path, out: Path) -> dict | None:
    """Quantize in a child process; returns its anchor.json (seconds, peak RSS, and for W8A8 the
    activation quantization to simulate), or None for a missing anchor. An output left by an
    earlier run in the same work folder is reused."""
    if (out / "anchor.json").exists() and (out / "dense").is_dir():
        log(f"{method} w{bits}: reusing {out}")
        return json.loads((out / "anchor.json").read_text())
    common = ["--model", str(args.model), "--windows", str(windows_file), "--bits", str(bits),
              "--group-size", str(args.group_size), "--out", str(out)]
    if method in OURS:
        cmd = [sys.executable, __file__, "--worker", method, *common]
    else:
        venv, script, extra = ANCHORS[method]
        python = REPO / ".anchors" / venv / "bin" / "python"
        if not python.exists():
            log(f"{method}: skipped, no virtualenv (run bench/anchors/setup.sh {venv})")
            return None
        cmd = [str(python), str(REPO / "bench" / "anchors" / script), *common, *extra]
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        log(f"{method} w{bits} failed:\n{done.stderr[-3000:]}")
        return None
    return json.loads((out / "anchor.json").read_text())


def worker(argv: list[str]) -> None:
    """One of our methods, in this process, with the anchors' arguments: writes out/dense
    (float32) and out/anchor.json. The model streams from the checkpoint (GPTQ and AWQ one decoder
    layer at a time; RTN one tensor at a time), as in a recipe, so the peak RSS is the streaming one."""
    parser = argparse.ArgumentParser()
    parser.add_argument("method", choices=OURS)
    for flag in ("--model", "--windows", "--out"):
        parser.add_argument(flag, type=Path, required=True)
    parser.add_argument("--bits", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from formats.hf import HFCheckpoint, is_linear_weight
    from quant.awq import awq_model
    from quant.gptq import GPTQSettings
    from quant.gptq_model import gptq_model
    from quant.rtn import quantize_rtn
    from quant.smoothquant import rtn_layer, smoothquant_model
    from core.schemes import QuantSpec

    windows = load_file(str(args.windows))["input_ids"]
    ckpt = HFCheckpoint.open(args.model)
    spec = QuantSpec(args.bits, SYMMETRIC.get(args.method, True), "group", args.group_size,
                     "mse" if args.method == "rtn-mse" else "minmax")
    extra = {}
    start = time.perf_counter()
    if args.method.startswith("rtn"):
        fitted = {n: quantize_rtn(ckpt.tensor(n).float(), spec, n) for n in ckpt.names
                  if n.startswith("model.layers.") and is_linear_weight(n, ckpt.shape(n))}
    elif args.method == "awq":
        fitted = {n: p for layer in awq_model(ckpt, windows, spec) for n, p in layer.tensors.items()}
    elif args.method in W8A8:  # SmoothQuant α 0.5, int8 weights per channel, int8 activations per token
        int8 = QuantSpec(8, True, "channel")
        layers = list(smoothquant_model(ckpt, windows, 0.5, lambda step: rtn_layer(step, int8)))
        fitted = {n: t for layer in layers for n, t in layer.tensors.items()}
        extra = {"activations": {"format": "int8", "modules": [m for layer in layers for m in layer.statistics]}}
    else:
        layers = gptq_model(ckpt, windows, spec, GPTQSettings(act_order=args.method == "gptq-actorder"))
        fitted = {n: r.tensor for layer in layers for n, r in layer.items()}
    seconds = time.perf_counter() - start
    save_dense(ckpt, fitted, args.out / "dense")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (args.out / "anchor.json").write_text(json.dumps({"tool": f"quantbench {args.method}", "seconds": seconds, "peak_rss_mb": peak, **extra}))


def save_dense(ckpt, fitted: dict, folder: Path) -> None:
    """The model with the ``fitted`` tensors (payloads by name) in place, as a float32 folder."""
    import torch

    from formats.hf import DenseSafetensorsWriter
    from core.tensors import dequantized

    writer = DenseSafetensorsWriter(folder, [(n, ckpt.shape(n)) for n in ckpt.names], torch.float32, ckpt)
    for name in ckpt.names:
        writer.add(name, dequantized(fitted.pop(name)) if name in fitted else ckpt.tensor(name))
    writer.finish()


def activation_simulation(model, activations: dict | None):
    """The worker's activation quantization on the model's Linear inputs, or nothing."""
    from contextlib import nullcontext

    from core.schemes import ActivationSpec
    from quant.activations import simulated_activations

    if activations is None:
        return nullcontext()
    return simulated_activations(model, ActivationSpec(activations["format"]), activations["modules"])


def load_dense(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def print_table(rows: list[dict], args) -> None:
    print(f"model {args.model}, calibration {args.calib_windows} x {args.window} tokens (seed {args.seed}), group size {args.group_size}")
    print(f"{'method':<20}{'bits':>5}{'sym':>5}{'ppl':>10}{'Δppl':>9}{'Δ/Δrtn':>8}{'KLD':>9}{'top-1':>8}{'s':>8}{'MiB':>7}")
    rtn = {r["bits"]: r["ppl_delta"] for r in rows if r["method"] == "rtn"}  # Δ/Δrtn: against symmetric RTN
    for r in rows:
        ratio = f"{r['ppl_delta'] / rtn[r['bits']]:.2f}" if rtn.get(r["bits"]) else ""
        sym = "" if r["symmetric"] is None else ("yes" if r["symmetric"] else "no")
        secs = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        rss = "" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        print(f"{r['method']:<20}{r['bits']:>5}{sym:>5}{r['ppl']:>10.3f}{r['ppl_delta']:>+9.3f}{ratio:>8}"
              f"{r['kld']:>9.4f}{r['top1']:>8.3f}{secs:>8}{rss:>7}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
