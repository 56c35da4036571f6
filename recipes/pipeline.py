"""The batch job behind ``quantize RECIPE.yaml``: quantize each variant, export it, score it, report.

Per variant, tensors stream from the source checkpoint one at a time through the quantizer into
every export writer and into the variant's weights kept on disk (formats/variant_weights.py), so
the files and the evaluated model are the same numbers by construction. The original and then each
variant are scored as their layers stream (evalsuite/streamed.py), never loaded whole; the
original's distributions are kept on disk for the variants' KLD (evalsuite/reference.py).
Everything a user could get wrong is checked before the
first tensor is touched. A rerun into the same output folder keeps every variant whose inputs are
unchanged since it last finished (recipes/resume.py) and redoes the rest. The variants are built
one after another here, or as Ray tasks (recipes/ray_executor.py), by the same ``run_variant``.
Each variant's folder gets a model card from the report (recipes/model_card.py).
"""

from __future__ import annotations

import shutil
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from calib.streaming import skeleton
from calib.text import sample_windows, token_windows
from core.errors import InputError
from evalsuite.metrics import Scores, causal_lm_logprobs
from evalsuite.recommend import Budget, recommend
from evalsuite.reference import ReferenceStore
from evalsuite.report import Report, VariantRow, compare_with_original, write_report
from evalsuite.streamed import streamed_scores
from evalsuite.tasks import Task, load_task, run_task
from formats.hf import HFCheckpoint, load_causal_lm, load_tokenizer
from formats.outputs import Outputs, check_output_path, folder_lock
from formats.registry import is_folder
from formats.sources import Source, open_checkpoint
from formats.variant_weights import VariantWeights
from quant.activations import simulated_activations
from quant.kv_cache import simulated_kv_cache
from recipes import lm_eval_tasks
from recipes.deploy import plan_deployment
from recipes.importance import model_imatrix
from recipes.lm_eval_tasks import LMEvalTask
from recipes.methods import Imatrix, method_of
from recipes.model_card import write_model_cards
from recipes.resume import ORIGINAL, RECORD, REFERENCE, SOURCE, Keys, finished, path_size, record, training_checkpoint
from recipes.schema import LOCAL, SOURCE_ROW, Calibration, Recipe, Variant, check_against_model, ray_address
from recipes.speed import engine_source
from recipes.variants import activation_modules, build_variant, export_paths, plan_variant


def run_recipe(recipe: Recipe, out_dir: Path, console: Console, executor: str | None = None) -> Report:
    """Run the job into ``out_dir``, which it holds locked for the while (formats/outputs.py), its
    variants built where ``executor`` (default: the recipe's) says (recipes/ray_executor.py)."""
    executor = executor or recipe.executor
    check_output_path(out_dir, folder=True)
    ckpt = open_checkpoint(recipe.model)
    check_against_model(recipe, ckpt.arch)
    baseline = None if recipe.reference is None else open_checkpoint(recipe.reference)
    if baseline is not None and (baseline.arch.vocab, baseline.arch.layers) != (ckpt.arch.vocab, ckpt.arch.layers):
        raise InputError(f"field 'reference': {recipe.reference} ({baseline.arch.layers} layers, vocabulary "
                         f"{baseline.arch.vocab}) is not the original of {recipe.model} ({ckpt.arch.layers} layers, "
                         f"vocabulary {ckpt.arch.vocab})")
    tasks = load_tasks(recipe)
    for v in recipe.variants:  # fails fast on any mismatch with the model, and on any path it cannot write
        plan_variant(ckpt, v, getattr(v.weights, "imatrix", False))
        for export, path in export_paths(ckpt, v, out_dir).items():
            check_output_path(path, folder=is_folder(export))
    with _executor(executor, recipe) as on_ray, folder_lock(out_dir) as killed:
        if killed:
            console.print(f"{out_dir}: taking over from a job that did not finish (pid {killed['pid']} on {killed['host']}, "
                          f"since {killed['since']}); its partial files are removed", markup=False, highlight=False)
        return _run(recipe, ckpt, baseline, tasks, out_dir, console, on_ray)


def _executor(executor: str, recipe: Recipe) -> AbstractContextManager[dict[str, dict] | None]:
    """Inside, the job's variants can be built where ``executor`` says: here (None), or on Ray
    (each variant's resource request, recipes/ray_executor.py)."""
    if executor == LOCAL:
        return nullcontext()
    from recipes.ray_executor import joined

    return joined(ray_address(executor), recipe)


def load_tasks(recipe: Recipe) -> list[Task | LMEvalTask]:
    """The recipe's tasks, in its order: ours read from their files, lm-eval's built by lm-eval."""
    specs = recipe.evaluation.tasks
    ours = {t.name: load_task(Path(t.task), t.name, t.limit, t.num_fewshot or 0) for t in specs if not t.runs_in_lm_eval}
    theirs = {t.name: t for t in lm_eval_tasks.prepare([t for t in specs if t.runs_in_lm_eval])}
    return [ours.get(t.name) or theirs[t.name] for t in specs]


def _run(recipe: Recipe, ckpt: Source, baseline: Source | None, tasks: list[Task | LMEvalTask], out_dir: Path,
         console: Console, on_ray: dict[str, dict] | None) -> Report:
    """Score the original (``baseline``, the reference, where given; else ``ckpt`` itself), then
    ``ckpt`` against it when they differ, then each variant of ``ckpt``: here, or as Ray tasks
    with the resources ``on_ray`` requests for each."""
    tokenizer = load_tokenizer(ckpt)
    ev = recipe.evaluation
    windows = token_windows(tokenizer, ev.text, ev.window, ev.max_windows)
    keys = Keys(recipe, ckpt, baseline)
    original_ckpt = baseline or ckpt
    kept = {v.name: finished(out_dir / v.name / RECORD, keys.variant(v), out_dir) for v in recipe.variants}
    todo = [v for v in recipe.variants if kept[v.name] is None]
    for name, row in kept.items():
        if row is not None:
            console.print(f"{name}: unchanged since it last finished; its files and scores are kept", markup=False)
    needs_imatrix = any(getattr(v.weights, "imatrix", False) for v in todo)
    needs_calibration = any(v.needs_calibration for v in todo)
    calib_windows = _calibration_windows(tokenizer, recipe.calibration) if needs_calibration else None

    # a new store of the original's distributions takes its name with the job's end: a failed job leaves none
    with progress_bar(console) as progress, Outputs() as job:
        original = finished(out_dir / ORIGINAL, keys.original(), out_dir)
        source_row = None if baseline is None else finished(out_dir / SOURCE, keys.original(), out_dir)
        store = ReferenceStore.find(out_dir / REFERENCE, windows, keys.original()) if todo else None
        if original is None or (baseline is not None and source_row is None) or (todo and store is None):
            fresh = job.stage(out_dir / REFERENCE)
            original = _source_row(progress, recipe, "original", original_ckpt, None, windows, tokenizer, tasks,
                                   keep=fresh, key=keys.original())
            store = ReferenceStore(fresh, windows)
            if baseline is not None:
                source_row = _source_row(progress, recipe, SOURCE_ROW, ckpt, store, windows, tokenizer, tasks)
        imatrix = None
        if needs_imatrix:
            imatrix = _tracked(progress, "importance matrix", ckpt.arch.layers,
                               lambda tick: model_imatrix(ckpt, calib_windows, tick))
        shared = VariantJob(recipe, out_dir, windows, calib_windows, store, imatrix, original.scores.ppl,
                            torch.get_num_threads())
        variant_keys = {v.name: keys.variant(v) for v in todo}
        if on_ray is None:
            opened = Opened(ckpt, tokenizer, tasks)
            built = {v.name: run_variant(shared, v, variant_keys[v.name], opened, progress) for v in todo}
        else:
            from recipes.ray_executor import run_on_ray

            built = run_on_ray(shared, todo, variant_keys, on_ray, console, progress)
        rows = [original] + ([source_row] if source_row is not None else [])
        for variant in recipe.variants:
            row = kept[variant.name] or built[variant.name]
            row.ppl_delta = row.scores.ppl - original.scores.ppl
            rows.append(row)
        job.commit()

    if source_row is not None:
        source_row.ppl_delta = source_row.scores.ppl - original.scores.ppl
    compare_with_original(rows)
    budget = Budget(**recipe.budget.model_dump()) if recipe.budget else None
    report = Report(model=str(recipe.model), eval_text=str(ev.text), windows=windows.shape[0],
                    window=windows.shape[1], rows=rows, recommendation=recommend(rows, budget, recipe.goal))
    if recipe.deploy is not None:
        report.deployment = plan_deployment(recipe.deploy, recipe.model, report.as_dict(), out_dir)
    write_report(report, out_dir)
    write_model_cards(report, recipe, ckpt.path, out_dir)
    record(out_dir / ORIGINAL, keys.original(), original)
    if source_row is not None:
        record(out_dir / SOURCE, keys.original(), source_row)
    return report


@dataclass(frozen=True)
class VariantJob:
    """What every variant of a job is built and scored from, made once by the job: picklable, so a
    Ray task gets the same (the store by its path, on the shared disk)."""

    recipe: Recipe
    out_dir: Path
    windows: torch.Tensor
    calibration: torch.Tensor | None
    store: ReferenceStore | None  # None when no variant is to be built
    imatrix: Imatrix | None
    original_ppl: float
    threads: int  # torch's threads in the job's process: GPTQ's float32 sums, and so its files, depend on it


@dataclass(frozen=True)
class Opened:
    """The job's model, tokenizer and tasks, as opened in the process that builds a variant."""

    ckpt: Source
    tokenizer: object
    tasks: list[Task | LMEvalTask]

    @classmethod
    def of(cls, recipe: Recipe) -> "Opened":
        ckpt = open_checkpoint(recipe.model)
        return cls(ckpt, load_tokenizer(ckpt), load_tasks(recipe))


def run_variant(job: VariantJob, variant: Variant, key: str, opened: Opened, progress: Progress) -> VariantRow:
    """Build, export and score one variant, commit its files and record it under ``key``
    (recipes/resume.py): the whole of a variant's work, the same in the local loop and a Ray task."""
    out_dir, ckpt, tokenizer, tasks = job.out_dir, opened.ckpt, opened.tokenizer, opened.tasks
    done = out_dir / variant.name / RECORD
    done.unlink(missing_ok=True)  # a crash from here on must not leave the old record standing
    start = time.perf_counter()
    uses = job.imatrix if getattr(variant.weights, "imatrix", False) else None
    checkpoint = training_checkpoint(out_dir, variant, key)
    # the variant's files get their names once it is scored; its kept weights are scratch
    with Outputs() as outputs, Outputs() as scratch:
        built = build_variant(ckpt, variant, out_dir, progress, imatrix=uses, calibration=job.calibration,
                              outputs=outputs, checkpoint=checkpoint,
                              keep=scratch.stage(out_dir / variant.name / ".weights"))
        weights, bits, files = built.weights, built.bits_per_weight, built.files
        scores = _tracked(progress, f"{variant.name}: evaluate", len(job.windows),
                          lambda tick: _variant_scores(weights, variant, job.windows, job.store, tick))
        engine = engine_source(ckpt.path, variant, files)
        if not isinstance(engine, str) and engine[0] != ckpt.path:  # its export, still staged
            engine = (outputs.staged(engine[0]), engine[1])
        answers = _variant_tasks(progress, weights, variant, tokenizer, tasks, engine) if tasks else {}
        outputs.commit()
    shutil.rmtree(checkpoint, ignore_errors=True)
    row = VariantRow(
        variant.name, _describe(variant) + (f" ({built.types_chosen})" if built.types_chosen else ""), bits, _size_mb(ckpt, bits), scores,
        ppl_delta=scores.ppl - job.original_ppl, seconds=time.perf_counter() - start,
        files=[_file_entry(f, out_dir) for f in files], input_statistics=built.input_statistics, tasks=answers,
        linear_errors=built.linear_errors, error_measure=built.error_measure,
        speed=_speed(progress, job.recipe, ckpt, variant, files, tokenizer),
    )
    record(done, key, row)
    return row


def _source_row(progress: Progress, recipe: Recipe, name: str, ckpt: Source, reference: ReferenceStore | None,
                windows: torch.Tensor, tokenizer, tasks: list[Task | LMEvalTask], keep: Path | None = None,
                key: str = "") -> VariantRow:
    """The row of a checkpoint as it is: the original, its distributions kept in ``keep``, or the
    model beside its reference. Scored as its layers stream; loaded whole only for the tasks."""
    start = time.perf_counter()
    scores = _tracked(progress, f"{name}: evaluate", len(windows),
                      lambda tick: streamed_scores(ckpt, windows, reference, keep=keep, key=key, on_window=tick))
    answers = {}
    if tasks:
        model = _load(progress, name, ckpt)
        answers = _tasks(progress, name, causal_lm_logprobs(model), tokenizer, ckpt, tasks, engine_source(ckpt.path, None, []))
        del model
    bits = ckpt.bits_per_weight
    return VariantRow(name, f"source ({ckpt.label})", bits, _size_mb(ckpt, bits), scores,
                      seconds=time.perf_counter() - start, tasks=answers, speed=_speed(progress, recipe, ckpt, None, [], tokenizer))


def _variant_scores(weights: VariantWeights, variant: Variant, windows: torch.Tensor, store: ReferenceStore,
                    tick: Callable[[], None]) -> Scores:
    """A variant scored as its layers stream from its kept weights, through its simulated
    activations and KV cache, against the original's distributions."""
    model = skeleton(weights)
    with _activations(model, weights, variant), _kv_cache(model, weights, variant):
        return streamed_scores(weights, windows, store, on_window=tick, model=model)


def _variant_tasks(progress: Progress, weights: VariantWeights, variant: Variant, tokenizer,
                   tasks: list[Task | LMEvalTask], engine: tuple[Path, str] | str) -> dict[str, dict]:
    """The variant's task answers; a task scores whole sequences, so the model is loaded whole."""
    model = _load(progress, variant.name, weights)
    with _activations(model, weights, variant), _kv_cache(model, weights, variant):
        return _tasks(progress, variant.name, causal_lm_logprobs(model), tokenizer, weights, tasks, engine)


def _load(progress: Progress, who: str, ckpt: Source) -> torch.nn.Module:
    loading = progress.add_task(f"{who}: load", total=None)
    try:
        return load_causal_lm(ckpt)
    finally:
        progress.remove_task(loading)


def _tasks(progress: Progress, who: str, logprobs, tokenizer, ckpt: HFCheckpoint, tasks: list[Task | LMEvalTask],
           engine: tuple[Path, str] | str) -> dict[str, dict]:
    """Each task's answers, right or wrong, example by example, and what guessing scores; text
    that a task generates comes from ``engine`` (what the engine runs as this model, with its KV
    cache; a string: why it cannot, and the evaluated model generates)."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    context = ckpt.arch.max_context or 2048
    generate = None if isinstance(engine, str) else lm_eval_tasks.engine_generator(*engine)
    answers = {}
    for task in tasks:
        label = progress.add_task(f"{who}: {task.name}", total=None)
        try:
            if isinstance(task, Task):
                answers[task.name] = {"correct": run_task(logprobs, tokenizer, task, context, ckpt.arch.vocab, bos),
                                      "chance": task.chance}
            else:
                answers[task.name] = lm_eval_tasks.run(task, logprobs, tokenizer, context, ckpt.arch.vocab, bos, generate)
        finally:
            progress.remove_task(label)
    return answers


def _speed(progress: Progress, recipe: Recipe, ckpt: HFCheckpoint, variant: Variant | None, files: list[Path],
           tokenizer) -> dict | None:
    """The variant's (None: the original's) measured speed, when the recipe asks for it."""
    if recipe.speed is None:
        return None
    from recipes.speed import measure

    task = progress.add_task(f"{variant.name if variant else 'original'}: speed", total=None)
    try:
        return measure(ckpt.path, variant, files, recipe.speed, recipe.evaluation.text, tokenizer)
    finally:
        progress.remove_task(task)


def _calibration_windows(tokenizer, calibration: Calibration) -> torch.Tensor:
    return sample_windows(tokenizer, calibration.text, calibration.window, calibration.max_windows, calibration.seed)


def _activations(model: torch.nn.Module, ckpt: HFCheckpoint, variant: Variant) -> AbstractContextManager[None]:
    """Inside, the model's Linear inputs are quantized as the variant's activations say (if at all)."""
    if variant.activations is None:
        return nullcontext()
    return simulated_activations(model, variant.activations.spec, activation_modules(ckpt, variant))


def _kv_cache(model: torch.nn.Module, ckpt: HFCheckpoint, variant: Variant) -> AbstractContextManager[None]:
    """Inside, the model's attention reads its keys and values through the variant's KV cache."""
    if variant.kv_cache is None:
        return nullcontext()
    return simulated_kv_cache(model, variant.kv_cache.spec, ckpt.arch.rope_pairs_adjacent_in_gguf)


def _describe(variant: Variant) -> str:
    kv = f" {variant.kv_cache.spec.label}" if variant.kv_cache else ""
    return _describe_weights(variant) + kv


def _describe_weights(variant: Variant) -> str:
    label = method_of(variant.weights).describe(variant.weights)
    a = variant.activations
    if a is not None:
        label += f" {a.spec.label}" + (f" smoothquant-{a.smoothquant:g}" if a.smoothquant is not None else "")
    return label


def _size_mb(ckpt: HFCheckpoint, bits_per_weight: float) -> float:
    return sum(_numel(ckpt.shape(n)) for n in ckpt.names) * bits_per_weight / 8e6


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _file_entry(path: Path, out_dir: Path) -> dict:
    return {"path": str(path.relative_to(out_dir)), "bytes": path_size(path)}


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )



def _tracked(progress: Progress, label: str, total: int, run: Callable[[Callable[[], None]], object]):
    task = progress.add_task(label, total=total)
    try:
        return run(lambda: progress.advance(task))
    finally:
        progress.remove_task(task)
