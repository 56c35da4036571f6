"""QAT against RTN, GPTQ and torchao's QAT on the same calibration windows: does training recover
what 2- and 3-bit post-training quantization loses?

    python bench/qat_table.py --model DIR --calib FILE --eval FILE [--json]
        [--configs 4:128 3:128 2:64] [--methods rtn gptq qat torchao-qat] [--calib-windows 32]
        [--window 512] [--seed 0] [--eval-windows 16] [--steps 200] [--lr 0.02] [--batch 2]
        [--e2e-steps 0] [--e2e-lr 1e-3] [--torchao-steps 400] [--torchao-lr 1e-4] [--gguf]

Every method quantizes the decoder's Linear weights asymmetrically (the grid QAT defaults to) at
each ``bits:group_size`` config from the same calibration windows, in its own process (so its time
and peak RSS are its own, the model streaming one decoder layer at a time as in a recipe), and is
scored against the unquantized model on consecutive 512-token windows of the evaluation text.
``torchao-qat`` is torchao 0.18's QAT (bench/anchors/torchao_qat.py, in the virtualenv of
``bench/anchors/setup.sh torchao``; skipped with a note without it): the whole model fine-tuned
end to end through torchao's fake quantization, by the same KL distillation from the float model.
The baseline of each config is GPTQ in the same run: ``Δ/Δgptq`` is a method's perplexity increase
over GPTQ's. Prints a table; with ``--json``, a list of rows on stdout, each with ``method``
(``rtn``, ``gptq``, ``qat``, ``torchao-qat``), ``bits``, ``group_size``, ``ppl``, ``ppl_delta``,
``kld``, ``top1``, ``seconds``, ``peak_rss_mb`` (the unquantized model is the row with method
``none``). With ``--gguf``, four more rows (``bits`` null): QAT models on Q4_0's grid and on
Q4_K_M's as GGUF files and llama.cpp's own Q4_0 and Q4_K_M of the original, each with llama.cpp's
perplexity on the evaluation windows (``ppl``) and its ``file_mb``.
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

from ptq_table import add_window_arguments, load_dense, log, open_windows, save_dense  # noqa: E402  (bench/ is this script's folder)

METHODS = ("rtn", "gptq", "qat", "torchao-qat")


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_arguments(parser, calib_windows=32, eval_windows=16)
    parser.add_argument("--configs", nargs="*", default=["4:128", "3:128", "2:64"], help="bits:group_size (none: only --gguf)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--e2e-steps", type=int, default=0, help="QAT's end-to-end phase after the layers")
    parser.add_argument("--e2e-lr", type=float, default=1e-3)
    parser.add_argument("--methods", nargs="*", choices=METHODS, default=list(METHODS))
    parser.add_argument("--torchao-steps", type=int, default=400, help="torchao's QAT: end-to-end steps")
    parser.add_argument("--torchao-lr", type=float, default=1e-4)
    parser.add_argument("--gguf", action="store_true", help="also: a Q4_0 QAT file against llama.cpp's Q4_0 and Q4_K_M, in llama.cpp")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs]

    from safetensors.torch import save_file

    from evalsuite.metrics import causal_lm_logprobs, score
    from formats.hf import load_causal_lm

    ckpt, calib, evaluation = open_windows(args)
    work = Path(tempfile.mkdtemp(prefix="qat_table_"))
    windows_file = work / "windows.safetensors"
    save_file({"input_ids": calib.contiguous()}, str(windows_file))
    log(f"calibration: {len(calib)} windows of {args.window} tokens (seed {args.seed}); evaluation: {len(evaluation)} windows of 512")

    reference = causal_lm_logprobs(load_causal_lm(ckpt))
    base = score(reference, evaluation)
    rows = [dict(method="none", bits=16, group_size=None, ppl=base.ppl, ppl_delta=0.0, kld=0.0, top1=1.0,
                 seconds=None, peak_rss_mb=None)]
    for bits, group in configs:
        for method in args.methods:
            out = work / f"{method}-w{bits}g{group}"
            run = run_worker(method, bits, group, args, windows_file, out)
            if run is None:
                continue
            s = score(causal_lm_logprobs(load_dense(out / "dense")), evaluation, reference)
            rows.append(dict(method=method, bits=bits, group_size=group, ppl=s.ppl, ppl_delta=s.ppl - base.ppl, kld=s.kld,
                             top1=s.top1, seconds=run["seconds"], peak_rss_mb=run["peak_rss_mb"]))
            log(f"{method} w{bits}g{group}: ppl {s.ppl:.3f} ({s.ppl - base.ppl:+.3f}), kld {s.kld:.4f}, "
                f"{run['seconds']:.1f} s, {run['peak_rss_mb']:.0f} MiB")
    if args.gguf:
        rows += gguf_rows(args, work, evaluation)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, args)


def gguf_rows(args, work: Path, evaluation) -> list[dict]:
    """QAT models as Q4_0 and Q4_K_M GGUF files, against llama.cpp's own Q4_0 and Q4_K_M of the
    original (our GGUF writer's files are byte-identical to llama.cpp's quantizer's), each scored
    by llama.cpp (llama-cpp-python) on the evaluation windows: perplexity and file size."""
    import yaml
    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(args.model.resolve()),
              "evaluation": {"text": str(args.eval.resolve()), "window": 512, "max_windows": 2},
              "calibration": {"text": str(args.calib.resolve()), "window": args.window, "max_windows": args.calib_windows,
                              "seed": args.seed},
              "variants": [*({"name": f"qat-{t.lower()}", "exports": ["gguf"],
                              "weights": {"method": "qat", "gguf": t, "steps": args.steps, "lr": args.lr, "batch": args.batch,
                                          "e2e_steps": args.e2e_steps, "e2e_lr": args.e2e_lr}} for t in ("Q4_0", "Q4_K_M")),
                           {"name": "q4_0", "weights": {"method": "gguf", "type": "Q4_0"}, "exports": ["gguf"]},
                           {"name": "q4_k_m", "weights": {"method": "gguf", "type": "Q4_K_M"}, "exports": ["gguf"]}]}
    path = work / "gguf.yaml"
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    run_recipe(load_recipe(path), work / "gguf", Console(stderr=True, quiet=True))
    log(f"GGUF variants built in {time.perf_counter() - start:.0f} s")
    rows = []
    for name in ("qat-q4_0", "q4_0", "qat-q4_k_m", "q4_k_m"):
        (gguf,) = (work / "gguf" / name).glob("*.gguf")
        ppl = llama_cpp_perplexity(gguf, evaluation)
        rows.append(dict(method=f"llama.cpp {name}", bits=None, group_size=None, ppl=ppl, ppl_delta=None, kld=None,
                         top1=None, seconds=None, peak_rss_mb=None, file_mb=gguf.stat().st_size / 1e6))
        log(f"llama.cpp {name}: ppl {ppl:.3f}, {gguf.stat().st_size / 1e6:.2f} MB")
    return rows


def llama_cpp_perplexity(gguf: Path, evaluation) -> float:
    import math

    import numpy as np
    import torch
    from llama_cpp import Llama

    width = evaluation.shape[1]
    llm = Llama(model_path=str(gguf), n_ctx=width, n_batch=width, logits_all=True, verbose=False)
    nll = 0.0
    for window in evaluation.tolist():
        llm.reset()
        llm.eval(window)
        logits = torch.tensor(np.asarray(llm.scores[: width - 1]), dtype=torch.float64)
        nll -= torch.log_softmax(logits, -1)[torch.arange(width - 1), torch.tensor(window[1:])].sum().item()
    return math.exp(nll / (evaluation.shape[0] * (width - 1)))


def run_worker(method: str, bits: int, group: int, args, windows_file: Path, out: Path) -> dict | None:
    """One method in a child process (torchao's in its own virtualenv); its seconds and peak RSS,
    or None (with a note) where it failed or its virtualenv is missing."""
    common = ["--model", str(args.model), "--windows", str(windows_file), "--bits", str(bits), "--group-size", str(group),
              "--out", str(out), "--batch", str(args.batch)]
    if method == "torchao-qat":
        python = REPO / ".anchors" / "torchao" / "bin" / "python"
        if not python.exists():
            log("torchao-qat: skipped, no virtualenv (run bench/anchors/setup.sh torchao)")
            return None
        cmd = [str(python), str(REPO / "bench" / "anchors" / "torchao_qat.py"), *common,
               "--steps", str(args.torchao_steps), "--lr", str(args.torchao_lr), "--seed", str(args.seed)]
        result = out / "anchor.json"
    else:
        cmd = [sys.executable, __file__, "--worker", method, *common, "--steps", str(args.steps), "--lr", str(args.lr),
               "--e2e-steps", str(args.e2e_steps), "--e2e-lr", str(args.e2e_lr)]
        result = out / "run.json"
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        log(f"{method} w{bits}g{group} failed:\n{done.stderr[-3000:]}")
        return None
    return json.loads(result.read_text())


def worker(argv: list[str]) -> None:
    """One method in this process: writes out/dense (float32) and out/run.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("method", choices=METHODS[:3])
    for flag in ("--model", "--windows", "--out"):
        parser.add_argument(flag, type=Path, required=True)
    for flag in ("--bits", "--group-size", "--steps", "--batch", "--e2e-steps"):
        parser.add_argument(flag, type=int, required=True)
    for flag in ("--lr", "--e2e-lr"):
        parser.add_argument(flag, type=float, required=True)
    args = parser.parse_args(argv)

    from safetensors.torch import load_file

    from formats.hf import HFCheckpoint, is_linear_weight
    from quant.gptq_model import gptq_model
    from quant.qat import QATSettings, qat_model
    from quant.rtn import quantize_rtn
    from core.schemes import QuantSpec

    windows = load_file(str(args.windows))["input_ids"]
    ckpt = HFCheckpoint.open(args.model)
    spec = QuantSpec(args.bits, False, "group", args.group_size)
    start = time.perf_counter()
    if args.method == "rtn":
        fitted = {n: quantize_rtn(ckpt.tensor(n).float(), spec, n) for n in ckpt.names
                  if n.startswith("model.layers.") and is_linear_weight(n, ckpt.shape(n))}
    elif args.method == "gptq":
        fitted = {n: r.tensor for layer in gptq_model(ckpt, windows, spec) for n, r in layer.items()}
    else:
        settings = QATSettings(steps=args.steps, lr=args.lr, batch=args.batch, e2e_steps=args.e2e_steps, e2e_lr=args.e2e_lr)
        fitted = {n: p for layer in qat_model(ckpt, windows, spec, settings) for n, p in layer.tensors.items()}
    seconds = time.perf_counter() - start
    save_dense(ckpt, fitted, args.out / "dense")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (args.out / "run.json").write_text(json.dumps({"seconds": seconds, "peak_rss_mb": peak}))


def print_table(rows: list[dict], args) -> None:
    print(f"model {args.model}, calibration {args.calib_windows} x {args.window} tokens (seed {args.seed}), "
          f"QAT {args.steps} steps per layer, lr {args.lr:g}, batch {args.batch}, "
          f"{args.e2e_steps} end-to-end steps, lr {args.e2e_lr:g}; torchao {args.torchao_steps} steps, lr {args.torchao_lr:g}; "
          "all grids asymmetric")
    print(f"{'method':<12}{'bits':>5}{'group':>6}{'ppl':>10}{'Δppl':>9}{'Δ/Δgptq':>9}{'KLD':>9}{'top-1':>8}{'s':>8}{'MiB':>7}")
    gptq = {(r["bits"], r["group_size"]): r["ppl_delta"] for r in rows if r["method"] == "gptq"}
    for r in rows:
        base = gptq.get((r["bits"], r["group_size"]))
        ratio = f"{r['ppl_delta'] / base:.2f}" if base else ""
        group = "" if r["group_size"] is None else str(r["group_size"])
        secs = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        rss = "" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        if r["bits"] is None:  # a GGUF file scored by llama.cpp
            print(f"{r['method']:<22}{r['ppl']:>10.3f}  {r['file_mb']:.2f} MB")
            continue
        print(f"{r['method']:<12}{r['bits']:>5}{group:>6}{r['ppl']:>10.3f}{r['ppl_delta']:>+9.3f}{ratio:>9}"
              f"{r['kld']:>9.4f}{r['top1']:>8.3f}{secs:>8}{rss:>7}")


if __name__ == "__main__":
    main()
