"""Resuming a recipe job: a variant whose inputs are unchanged since it last finished is not redone.

A finished variant leaves ``<out>/<variant>/.done.json``: its report row and a key over everything
that decided it: its entry in the recipe, the model folder (config.json, and the name, size and
modification time of every file in it, which covers weights and tokenizer), the evaluation text and
settings, for calibrated variants the calibration text and settings, and quantbench's own source
(so an upgrade, or a fix, redoes what it may have changed). A rerun into the same
output folder takes the row of every variant whose key matches and whose files are all still there
at their recorded sizes; the others are built and scored again. The original's row is kept the same
way (``<out>/.original.json``), so a rerun with nothing to do loads no model at all. To redo a
variant regardless, delete its folder.

A variant that trains (QAT) keeps its progress in ``<out>/<variant>/.training-<key>/`` until it
finishes, so a job killed mid-training takes up from the last saved layer or step when rerun with
the same inputs; with other inputs the folder is stale and removed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import metadata
from pathlib import Path

from evalsuite.metrics import Scores
from evalsuite.report import VariantRow
from formats.hf import HFCheckpoint
from formats.outputs import Outputs
from recipes.lm_eval_tasks import read_yaml
from recipes.schema import Recipe, TaskSpec, Variant

RECORD = ".done.json"
ORIGINAL = ".original.json"
SOURCE = ".source.json"  # the model's own row, when a reference is the baseline
REFERENCE = ".reference"  # the original's distributions on the evaluation windows (evalsuite/reference.py)


class Keys:
    """The resume keys of one job's original and variants."""

    def __init__(self, recipe: Recipe, ckpt: HFCheckpoint, reference: HFCheckpoint | None = None):
        ev = recipe.evaluation
        self._evaluation = {
            "quantbench": _source_digest(),
            "model": {"config": ckpt.config, "files": _folder_stat(ckpt.path)},
            "reference": None if reference is None else {"config": reference.config, "files": _folder_stat(reference.path)},
            "evaluation": {"text": _sha256(ev.text), "window": ev.window, "max_windows": ev.max_windows,
                           "tasks": [{**_task_inputs(t), "limit": t.limit, "num_fewshot": t.num_fewshot}
                                     for t in ev.tasks]},
            "speed": recipe.speed.model_dump() if recipe.speed else None,
        }
        cal = recipe.calibration
        self._calibration = None if cal is None else {
            "text": _sha256(cal.text), "window": cal.window, "max_windows": cal.max_windows, "seed": cal.seed,
        }

    def original(self) -> str:
        return _digest(self._evaluation)

    def variant(self, variant: Variant) -> str:
        inputs = dict(self._evaluation, variant=variant.model_dump(mode="json"))
        if variant.needs_calibration:
            inputs["calibration"] = self._calibration
        return _digest(inputs)


def finished(path: Path, key: str, out_dir: Path) -> VariantRow | None:
    """The row recorded at ``path`` if its key is ``key`` and its files are intact, else None."""
    try:
        record = json.loads(path.read_text())
        if record["key"] != key:
            return None
        row = record["row"]
        scores = Scores(**{k: row.pop(k) for k in ("ppl", "kld", "top1", "tokens", "per_window")})
        row = VariantRow(scores=scores, **row)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for f in row.files:
        target = out_dir / f["path"]
        if not target.exists() or path_size(target) != f["bytes"]:
            return None
    return row


def training_checkpoint(out_dir: Path, variant: Variant, key: str) -> Path:
    """The folder the variant's training may keep its progress in (created by the trainer, only
    if it trains), named by the variant's key; other keys' folders are removed."""
    folder = out_dir / variant.name / f".training-{key[:16]}"
    for stale in (out_dir / variant.name).glob(".training-*"):
        if stale != folder:
            shutil.rmtree(stale, ignore_errors=True)
    return folder


def record(path: Path, key: str, row: VariantRow) -> None:
    """Write the record under a temporary name and rename it: a crash leaves none, never half of one."""
    with Outputs() as outputs:
        outputs.stage(path).write_text(json.dumps({"key": key, "row": row.as_dict()}, indent=1) + "\n")
        outputs.commit()


def _source_digest() -> str:
    """A digest of the code that builds and scores variants."""
    import calib
    import evalsuite
    import formats
    import quant
    import recipes

    digest = hashlib.sha256()
    for package in (calib, evalsuite, formats, quant, recipes):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _task_inputs(task: TaskSpec) -> dict:
    """What a task's results depend on besides the model: our task file; for lm-eval, its
    version and the YAML with the local data files it names, or the registered name."""
    if not task.runs_in_lm_eval:
        return {"file": _sha256(Path(task.task))}
    try:
        version = metadata.version("lm-eval")
    except metadata.PackageNotFoundError:
        version = None
    if not task.is_file:
        return {"lm_eval": version, "name": task.task}
    path = Path(task.task)
    config = read_yaml(path)
    data = (config.get("dataset_kwargs") or {}).get("data_files") if isinstance(config, dict) else None
    local = [path.parent / f for f in _strings(data)]
    return {"lm_eval": version, "yaml": _sha256(path), "data": {str(f): _sha256(f) for f in sorted(local) if f.is_file()}}


def _strings(value) -> list[str]:
    """Every string in a YAML value (lm-eval's data_files: a path, a list, or a split -> either)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [s for v in value for s in _strings(v)] if isinstance(value, list) else []


def _folder_stat(source: Path) -> dict[str, list[int]]:
    """Size and time of the source's files: a model folder's, or a GGUF file's own."""
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def path_size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (an export may be either)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
