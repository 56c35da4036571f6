"""The recipe file: one model, one evaluation text, several variants, each with its exports.

Validation happens here, before any work: a wrong field, value or path fails with one line that
names it, so a long batch job never dies half-way on a typo.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, field_validator, model_validator

from core.architecture import Architecture
from core.errors import InputError
from core.schemes import ActivationSpec
from formats.hub import parse_hub_id
from formats.registry import FORMATS
from quant.kv_cache import KVCacheSpec
from recipes.fields import Strict
from recipes.methods import METHODS, method_of


def _no_nul(path: Path) -> Path:
    if "\0" in str(path):
        raise ValueError("a path cannot hold a NUL byte")
    return path


FilePath = Annotated[Path, AfterValidator(_no_nul)]  # a path in a recipe: any the operating system can open


class KVCache(Strict):
    """The KV cache in a smaller type, simulated in the evaluation (quant/kv_cache.py): ``int8`` and
    ``int4`` are llama.cpp's q8_0 and q4_0 cache types, ``fp8`` vLLM's e4m3 cache without scales."""

    format: Literal["fp8", "int8", "int4"]

    @property
    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.format)


class Activations(Strict):
    """Per-token dynamic quantization of the inputs of every Linear whose weights the variant
    quantizes (W8A8 and friends), simulated in the evaluation; SmoothQuant (α, or null for none)
    first moves the activations' outliers into the weights (quant/smoothquant.py)."""

    format: Literal["int8", "fp8"] = "int8"
    smoothquant: float | None = Field(default=0.5, ge=0, le=1)

    @property
    def spec(self) -> ActivationSpec:
        return ActivationSpec(self.format)


# the weights classes of the methods (recipes/methods/), told apart by their ``method``
Weights = Annotated[Union[tuple(m.weights for m in METHODS.values())], Field(discriminator="method")]  # type: ignore[misc]
Export = Literal[tuple(FORMATS)]  # type: ignore[valid-type]  # the export formats (formats/registry.py)


class Variant(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)
    weights: Weights
    activations: Activations | None = None
    kv_cache: KVCache | None = None
    exports: list[Export] = []

    @property
    def needs_calibration(self) -> bool:
        return self.weights.calibrated or self.activations is not None

    @model_validator(mode="after")
    def _gguf_needs_gguf_weights(self) -> "Variant":
        w = self.weights
        method = method_of(w)
        file_type = method.gguf_type(w)
        for export in self.exports:
            if FORMATS[export].ggml and file_type is None:
                raise ValueError(f"a {export} export needs 'weights: {{method: gguf, type: ...}}' "
                                 "(or {method: qat, gguf: Q4_0 | Q4_K_M | ...})")
        if method.on_grid and file_type is not None and any(FORMATS[e].codes for e in self.exports):
            raise ValueError(f"{w.method} weights on the {file_type} grid export as gguf (and safetensors)")
        return self

    @model_validator(mode="after")
    def _quantized_exports_hold_the_weights(self) -> "Variant":
        """Each export of codes (formats/registry.py) must hold the weights' grid, as its format says."""
        w = self.weights
        activations = self.activations.spec if self.activations else None
        on_grid = [name for name, m in METHODS.items() if m.on_grid]
        for export in self.exports:
            fmt = FORMATS[export]
            if not fmt.codes:
                continue
            if not method_of(w).on_grid:
                raise ValueError(f"a {export} export needs {', '.join(on_grid[:-1])} or {on_grid[-1]} weights, not {w.method}")
            if getattr(w, "outliers", None) is not None:
                raise ValueError(f"a {export} export cannot hold outlier columns kept in 16 bits")
            if getattr(w, "searches_bits", False) and not fmt.mixes_grids:
                mixing = [name for name, f in FORMATS.items() if f.mixes_grids]
                raise ValueError(f"a {export} export holds one grid, not the mix bits auto chooses; use {' or '.join(mixing)}")
            try:
                for grid in getattr(w, "grids", [w.spec]):
                    fmt.check(grid, activations)
            except ValueError as e:
                raise ValueError(f"a {export} export cannot hold {e}") from None
            if getattr(w, "act_order", False) and not w.static_groups and w.group_size and not fmt.holds_group_index:
                raise ValueError(f"a {export} export cannot hold GPTQ's act-order groups (g_idx); "
                                 "use static_groups: true, or the gptq export")
        return self

    @model_validator(mode="after")
    def _activations_need_rtn_or_gptq_weights(self) -> "Variant":
        if self.activations is None:
            return self
        if self.weights.method not in ("rtn", "gptq"):
            raise ValueError(f"activations need rtn or gptq weights, not {self.weights.method}")
        if getattr(self.weights, "outliers", None) is not None:
            raise ValueError("outliers (16-bit weight columns) are for weight-only variants; with activations use smoothquant")
        if self.weights.searches_bits:
            raise ValueError("bits auto chooses weight-only grids (W4A16, W8A16), not grids for quantized activations")
        return self


BUNDLED_TASKS = Path(__file__).parent / "bundled" / "tasks"  # name.jsonl: the tasks shipped with quantbench


TASK_FILES = (".jsonl",)  # our task files (evalsuite/tasks.py)
LM_EVAL_FILES = (".yaml", ".yml")  # lm-eval task configs


class TaskSpec(Strict):
    """One task of the report, its first ``limit`` examples after ``num_fewshot`` answered ones
    (default: none for ours, the task's own number for lm-eval's):
    - a bundled task's name (``persuasion_cloze``, ``persuasion_order``) or a task file (.jsonl,
      evalsuite/tasks.py), scored by our own scorer;
    - an lm-eval task YAML (.yaml), or the name of a task or group lm-eval knows (``arc_easy``,
      ``mmlu``) whose data is already on this machine, run by lm-eval's evaluator through
      evalsuite/lm_eval_bridge.py."""

    task: str = Field(min_length=1)
    limit: int | None = Field(default=None, ge=1)
    num_fewshot: int | None = Field(default=None, ge=0, le=64)

    @property
    def runs_in_lm_eval(self) -> bool:
        suffix = Path(self.task).suffix
        return suffix in LM_EVAL_FILES or (suffix not in TASK_FILES and not (BUNDLED_TASKS / f"{self.task}.jsonl").is_file())

    @property
    def is_file(self) -> bool:
        return Path(self.task).suffix in TASK_FILES + LM_EVAL_FILES

    @property
    def name(self) -> str:
        return Path(self.task).stem if self.is_file else self.task

    def resolved(self, base: Path) -> "TaskSpec":
        """With a bundled task's file, or a file path relative to ``base`` (the recipe's folder)."""
        bundled = BUNDLED_TASKS / f"{self.task}.jsonl"
        if bundled.is_file():
            return self.model_copy(update={"task": str(bundled)})
        return self.model_copy(update={"task": str(base / self.task)}) if self.is_file else self


def _task_spec(value: object) -> object:
    return {"task": value} if isinstance(value, str) else value


def _unique(kind: str, items: list):
    names = [item.name for item in items]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{kind} names must be unique, repeated: {', '.join(dupes)}")
    return items


class Evaluation(Strict):
    text: FilePath
    window: int = Field(default=512, ge=16, le=32768)
    max_windows: int | None = Field(default=None, ge=1)
    tasks: list[Annotated[TaskSpec, BeforeValidator(_task_spec)]] = []

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        return _unique("task", tasks)


class Calibration(Strict):
    text: FilePath  # UTF-8 text, or .jsonl with a "text" field per line
    window: int = Field(default=512, ge=16, le=32768)
    max_windows: int = Field(default=128, ge=1)  # drawn at random (with seed) from the whole text
    seed: int = Field(default=0, ge=0, le=2**63 - 1)  # what torch's generator takes


class Speed(Strict):
    """Measured speed in the report: every variant that can run does this workload (prompts cut from
    the evaluation text, greedy, EOS ignored; runner/bench.py): the engine for the original, a KV
    cache, and compressed-tensors or GPTQ exports; llama.cpp for GGUF files."""

    requests: int = Field(default=32, ge=1)
    concurrency: int = Field(default=8, ge=1)
    prompt_tokens: list[Annotated[int, Field(ge=1)]] = Field(default=[32, 64, 128, 256], min_length=1)
    output_tokens: list[Annotated[int, Field(ge=1)]] = Field(default=[16, 64, 128, 256], min_length=1)


def _fraction(value: object) -> object:
    """``2%`` as 0.02; plain numbers as they are."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"'{value}' is not a percentage") from None
    return value


Fraction = Annotated[float, BeforeValidator(_fraction), Field(ge=0)]


class Budget(Strict):
    """The quality a customer accepts (evalsuite/recommend.py): ``kld`` in nats per token, ``top1``
    agreement, ``ppl_increase`` relative to the original's perplexity, ``task_drop`` in accuracy
    points on any task; fractions or percentages (``2%``)."""

    kld: float | None = Field(default=None, ge=0)
    top1: Fraction | None = Field(default=None, le=1)
    ppl_increase: Fraction | None = None
    task_drop: Fraction | None = Field(default=None, le=1)


def _duration(value: object) -> object:
    """``500ms``, ``0.5s`` or a number of milliseconds, in seconds (as ``quantize plan --ttft``)."""
    from runner.plan.cli import duration_seconds

    if isinstance(value, bool):
        raise ValueError("a positive duration, e.g. 500ms or 0.5s")
    if value is None or not isinstance(value, (str, int, float)):
        return value  # None stays; the rest fails the float check, naming the field
    return duration_seconds(str(value))


def _gpu_names(value: object) -> object:
    """``h100-80gb``, ``l4,a10`` or a list of names, as a list (``quantize plan --gpu``)."""
    from runner.fit.gpus import split_gpus

    return split_gpus(value) if isinstance(value, str) else value


def _known_gpus(names: list[str] | None) -> list[str] | None:
    from runner.fit.gpus import resolve_gpu

    for name in names or []:
        try:
            resolve_gpu(name)
        except InputError as e:
            raise ValueError(str(e).removeprefix("--gpu ")) from None
    return names


class Deploy(Strict):
    """The load the recommended variant must carry, planned in the report as ``quantize plan``
    plans it (runner/plan/, docs/plan.md): ``users`` requests in flight, their prompt and answer
    lengths, the p99 targets (``ttft: 500ms``, ``tpot: 30ms``; at least one), the GPUs to choose
    from (catalogue names or ``custom:MEM_GIB,BANDWIDTH_GBS,TFLOPS``; default: every catalogue
    GPU) and the share of each prompt a prefix cache holds."""

    users: int = Field(ge=1, le=1_000_000)
    prompt_tokens: int = Field(ge=1, le=10_000_000)
    output_tokens: int = Field(ge=1, le=10_000_000)
    ttft: Annotated[float, BeforeValidator(_duration)] | None = None
    tpot: Annotated[float, BeforeValidator(_duration)] | None = None
    gpu: Annotated[list[str], BeforeValidator(_gpu_names), AfterValidator(_known_gpus), Field(min_length=1)] | None = None
    prefix_share: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _needs_a_target(self) -> "Deploy":
        if self.ttft is None and self.tpot is None:
            raise ValueError("no target: give ttft, tpot or both (e.g. ttft: 500ms, tpot: 30ms)")
        return self


SOURCE_ROW = "source"  # the report's row of ``model`` when ``reference`` is its baseline

LOCAL = "local"  # the executor that builds the variants one after another in the job's process
_RAY = "ray"


def check_executor(executor: str) -> str:
    """``local``, ``ray`` (a local Ray started for the job) or ``ray=ADDRESS`` (a running cluster's,
    as ``ray.init`` takes it): the recipe's ``executor`` and the CLI's ``--executor`` alike."""
    if executor not in (LOCAL, _RAY) and not (executor.startswith(_RAY + "=") and executor[len(_RAY) + 1:].strip()):
        raise ValueError(f"'{executor}' is not local, ray or ray=ADDRESS (e.g. ray=ray://head:10001)")
    return executor


def ray_address(executor: str) -> str | None:
    """The cluster address of a ``ray=ADDRESS`` executor; None for ``ray`` (a local Ray)."""
    return executor.partition("=")[2] or None


def _model_at(base: Path, model: Path) -> Path:
    """A recipe's model: a path relative to ``base`` where one exists there, else a Hugging Face id
    as written (``org/name[@revision]``, fetched when the job opens it, formats/hub.py)."""
    here = base / model
    return model if not here.exists() and parse_hub_id(str(model)) else here


class Recipe(Strict):
    model: FilePath
    # the original of a quantized ``model``: the report's baseline, with ``model`` scored beside the variants
    reference: FilePath | None = None
    evaluation: Evaluation
    calibration: Calibration | None = None
    variants: list[Variant] = Field(min_length=1)
    output: FilePath | None = None
    speed: Speed | None = None
    budget: Budget | None = None
    goal: Literal["smallest", "fastest"] = "smallest"  # which variant within the budget to recommend
    deploy: Deploy | None = None  # a deployment to plan for the recommended variant, in the report
    executor: Annotated[str, AfterValidator(check_executor)] = LOCAL  # where the variants are built

    def based_at(self, base: Path) -> "Recipe":
        """The recipe with its relative paths taken as relative to ``base`` (the recipe's folder;
        the working directory, for a worker that has another)."""
        return self.model_copy(
            update={
                "model": _model_at(base, self.model),
                "reference": _model_at(base, self.reference) if self.reference else None,
                "evaluation": self.evaluation.model_copy(update={
                    "text": base / self.evaluation.text,
                    "tasks": [t.resolved(base) for t in self.evaluation.tasks]}),
                "calibration": self.calibration.model_copy(update={"text": base / self.calibration.text})
                if self.calibration else None,
                "output": base / self.output if self.output else None,
            }
        )

    @model_validator(mode="after")
    def _calibrated_variants_need_calibration(self) -> "Recipe":
        needing = [v.name for v in self.variants if v.needs_calibration]
        if needing and self.calibration is None:
            raise ValueError(f"variant '{needing[0]}' is fitted on calibration text: add 'calibration: {{text: ...}}'")
        return self

    @model_validator(mode="after")
    def _fastest_needs_speed(self) -> "Recipe":
        if self.goal == "fastest" and self.speed is None:
            raise ValueError("goal 'fastest' needs measured speed: add 'speed: {}'")
        if self.budget is not None and self.budget.task_drop is not None and not self.evaluation.tasks:
            raise ValueError("budget.task_drop needs tasks: add 'evaluation.tasks'")
        return self

    @field_validator("variants")
    @classmethod
    def _unique_names(cls, variants: list[Variant]) -> list[Variant]:
        return _unique("variant", variants)

    @model_validator(mode="after")
    def _source_row_name_is_free(self) -> "Recipe":
        if self.reference is not None and any(v.name == SOURCE_ROW for v in self.variants):
            raise ValueError(f"variant name '{SOURCE_ROW}' is the report's row of the model when a reference is given")
        return self


def check_against_model(recipe: Recipe, arch: Architecture) -> None:
    """Refuse what the model's config.json refutes: a window, or a deployment's prompt and answer,
    longer than the model's context."""
    context = arch.max_context
    if not context:
        return
    for part in ("evaluation", "calibration"):
        settings = getattr(recipe, part)
        if settings is not None and settings.window > context:
            raise InputError(f"field '{part}.window': {settings.window} tokens is longer than the context of "
                             f"{recipe.model} ({context} tokens, max_position_embeddings in its config.json)")
    d = recipe.deploy
    if d is not None and d.prompt_tokens + d.output_tokens > context:
        raise InputError(f"field 'deploy.prompt_tokens': {d.prompt_tokens} + output_tokens {d.output_tokens} tokens is longer "
                         f"than the context of {recipe.model} ({context} tokens): shorten the prompt to at most "
                         f"{max(1, context - d.output_tokens)} tokens")


def load_recipe(path: Path) -> Recipe:
    """Read and validate a recipe; relative paths in it are relative to the recipe's folder."""
    if not path.is_file():
        raise InputError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise InputError(f"{path}: malformed YAML{at}: {problem}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise InputError(f"{path}: malformed YAML: nested too deeply") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a recipe is a YAML mapping with 'model', 'evaluation' and 'variants'")
    try:
        data = expand_matrices(data)
    except ValueError as e:
        raise InputError(f"{path}: {e}") from None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise InputError(f"{path}: {_first_error(e, data)}") from None
    return recipe.based_at(path.parent)


_SHORT = {"bits": "w", "group_size": "g"}  # how a matrix names its variants: gptq-w4-g128


def expand_matrices(data: dict) -> dict:
    """The recipe with each variant that names a ``matrix`` (weights fields to lists of values,
    ``{bits: [2, 3, 4], group_size: [32, 128]}``) replaced by one variant per combination, in
    order, named after the template and its values (``gptq-w2-g32``), so a sweep is one entry
    that resumes, reports and errs variant by variant like any other."""
    variants = data.get("variants")
    if not isinstance(variants, list):
        return data
    expanded = []
    for index, entry in enumerate(variants):
        if not isinstance(entry, dict) or "matrix" not in entry:
            expanded.append(entry)
            continue
        where = f"variants[{index}]" + (f"({entry['name']})" if "name" in entry else "") + ".matrix"
        matrix, weights = entry["matrix"], entry.get("weights")
        if not isinstance(matrix, dict) or not matrix:
            raise ValueError(f"field '{where}': a mapping of weights fields to lists of values, e.g. {{bits: [3, 4]}}")
        if not isinstance(weights, dict):
            raise ValueError(f"field '{where}': a matrix varies the fields of the variant's 'weights', which it lacks")
        for key, values in matrix.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"field '{where}.{key}': a non-empty list of values")
            if key in weights:
                raise ValueError(f"field '{where}.{key}': also set in 'weights'; give it in one place")
        template = {k: v for k, v in entry.items() if k != "matrix"}
        for values in itertools.product(*matrix.values()):
            chosen = dict(zip(matrix, values))
            name = "-".join([str(entry.get("name", "variant"))] + [f"{_SHORT.get(k, k)}{v}" for k, v in chosen.items()])
            expanded.append(template | {"name": name, "weights": weights | chosen})
    return data | {"variants": expanded}


def _first_error(error: ValidationError, data: dict) -> str:
    """One line naming the field (``variants[1].weights.bits``) and what is wrong with it."""
    err = error.errors()[0]
    parts: list[str] = []
    node = data
    for loc in err["loc"]:
        if isinstance(loc, int):
            parts.append(f"[{loc}]")
            node = node[loc] if isinstance(node, list) and loc < len(node) else None
            if isinstance(node, dict) and "name" in node:
                parts.append(f"({node['name']})")
        elif isinstance(node, dict) and node.get("method") == loc and loc not in node:
            continue  # the tag pydantic adds for the chosen member of a union, not a field name
        elif parts and node is not None and not isinstance(node, (dict, list)):
            continue  # below a value given in the recipe: the tag of the union member that refused it (bits: int or auto)
        else:
            parts.append(f".{loc}" if parts else str(loc))
            node = node.get(loc) if isinstance(node, dict) else None
    field = "".join(parts) or "recipe"
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown field '{field}'"
    if kind == "missing":
        return f"missing field '{field}'"
    msg = err["msg"].removeprefix("Value error, ")
    return f"field '{field}': {msg}"
