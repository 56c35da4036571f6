"""The recipe file: one model, one evaluation text, several variants, each with its exports.

Validation happens here, before any work: a wrong field, value or path fails with one line that
names it, so a long batch job never dies half-way on a typo.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Callable, ClassVar, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from core.architecture import Architecture
from core.errors import InputError
from core.file_types import FILE_TYPES
from core.schemes import ActivationSpec
from core.schemes import FORMAT_BITS, NumberFormat, QuantSpec
from formats.awq import AWQWriter
from formats.awq import check_spec as awq_check_spec
from formats.bitsandbytes import BitsAndBytesWriter
from formats.bitsandbytes import check_spec as bnb_check_spec
from formats.compressed_tensors import CompressedTensorsWriter
from formats.compressed_tensors import layout as compressed_tensors_layout
from formats.gptq import GPTQWriter
from formats.gptq import check_spec as gptq_check_spec
from formats.hub import parse_hub_id
from quant.awq import AWQSettings
from quant.gptq import GPTQSettings
from quant.kv_cache import KVCacheSpec
from quant.outliers import OutlierRule
from quant.qat import E2E_STEPS, Q4_K, Grid, QATSettings


def _no_nul(path: Path) -> Path:
    if "\0" in str(path):
        raise ValueError("a path cannot hold a NUL byte")
    return path


FilePath = Annotated[Path, AfterValidator(_no_nul)]  # a path in a recipe: any the operating system can open


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Targeted(_Strict):
    """Which decoder Linear modules a method quantizes: name patterns (shell-style, e.g.
    ``*.mlp.*``) to include and to leave in full precision. The output head is never quantized."""

    targets: list[str] = Field(default=["*"], min_length=1)
    ignore: list[str] = []


class _GridWeights(_Targeted):
    """The number format and range fields that RTN and GPTQ share. Each is checked against the
    format in its own validator, so an error names the field (``weights.bits``), not the variant.
    Float formats have a fixed width: ``bits`` may be left out, and must match when given."""

    format: NumberFormat = "int"
    bits: int | None = Field(default=None, ge=2, le=8, validate_default=True)
    symmetric: bool = True
    range: Literal["minmax", "mse", "percentile"] = "minmax"
    percentile: float | None = Field(default=None, gt=50, le=100)  # with range 'percentile'; default 99.9

    @field_validator("bits")
    @classmethod
    def _bits_match_the_format(cls, bits: int | None, info: ValidationInfo) -> int | None:
        fmt = info.data.get("format")  # absent when invalid: that error is reported first
        if fmt == "int" and bits is None:
            raise PydanticCustomError("missing", "Field required")
        if fmt not in FORMAT_BITS:
            return bits
        if bits is not None and bits != FORMAT_BITS[fmt]:
            raise ValueError(f"format '{fmt}' is {FORMAT_BITS[fmt]} bits wide, not {bits} (bits may be left out)")
        return FORMAT_BITS[fmt]

    @field_validator("symmetric")
    @classmethod
    def _float_formats_are_symmetric(cls, symmetric: bool, info: ValidationInfo) -> bool:
        fmt = info.data.get("format", "int")
        if fmt != "int" and not symmetric:
            raise ValueError(f"format '{fmt}' is scale-only (no zero-point): symmetric must be true")
        return symmetric

    @field_validator("percentile")
    @classmethod
    def _percentile_needs_its_range(cls, percentile: float | None, info: ValidationInfo) -> float | None:
        if percentile is not None and info.data.get("range") != "percentile":
            raise ValueError("percentile is only valid with range 'percentile'")
        return percentile

    def _spec(self, granularity: str, group_size: int | None) -> QuantSpec:
        percentile = 99.9 if self.percentile is None else self.percentile
        return QuantSpec(self.bits, self.symmetric, granularity, group_size, self.range, self.format, percentile)


class Outliers(_Strict):
    """LLM.int8-style mixed precision: the input columns whose calibration activations exceed both
    ``threshold`` and ``relative`` times their Linear's median stay in fp16 (quant/outliers.py)."""

    threshold: float = Field(default=6.0, ge=0)
    relative: float = Field(default=3.0, ge=0)

    @property
    def rule(self) -> OutlierRule:
        return OutlierRule(self.threshold, self.relative)


class RTNWeights(_GridWeights):
    """Round-to-nearest quantization of the decoder's Linear weights."""

    method: Literal["rtn"]
    granularity: Literal["tensor", "channel", "group", "block"] = "channel"
    group_size: int | None = Field(default=None, ge=1)  # group: input columns; block: rows and columns
    outliers: Outliers | None = None  # {} for the defaults: fitted on the calibration text

    @property
    def calibrated(self) -> bool:  # each weights class: whether it needs calibration text
        return self.outliers is not None

    @model_validator(mode="after")
    def _group_size_matches_granularity(self) -> "RTNWeights":
        sized = self.granularity in ("group", "block")
        if sized and self.group_size is None:
            raise ValueError(f"granularity '{self.granularity}' needs group_size")
        if not sized and self.group_size is not None:
            raise ValueError(f"group_size is only valid with granularity 'group' or 'block', not '{self.granularity}'")
        return self

    @property
    def spec(self) -> QuantSpec:
        return self._spec(self.granularity, self.group_size)


class GPTQWeights(_GridWeights):
    """GPTQ on the decoder layers' Linear weights, fitted layer by layer on the calibration text."""

    method: Literal["gptq"]
    group_size: int | None = Field(default=128, ge=1)  # null: one scale per output channel
    act_order: bool = False
    static_groups: bool = False
    damp: float = Field(default=0.01, gt=0, le=1)
    calibrated: ClassVar[bool] = True

    @property
    def spec(self) -> QuantSpec:
        return self._spec("group" if self.group_size else "channel", self.group_size)

    @property
    def settings(self) -> GPTQSettings:
        return GPTQSettings(damp=self.damp, act_order=self.act_order, static_groups=self.static_groups)


class AWQWeights(_Targeted):
    """AWQ on the decoder layers' Linear weights: activation-aware scales folded into the norms and
    feeding Linear rows, clipping search, then round-to-nearest on the scaled weights."""

    method: Literal["awq"]
    bits: int = Field(ge=2, le=8)
    symmetric: bool = False
    group_size: int | None = Field(default=128, ge=1)
    weight_term: bool = True  # the weight-magnitude term of the scale search
    clip: bool = True
    calibrated: ClassVar[bool] = True

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.symmetric, "group" if self.group_size else "channel", self.group_size)

    @property
    def settings(self) -> AWQSettings:
        return AWQSettings(weight_term=self.weight_term, clip=self.clip)


# the GGUF file types QAT trains for, and the grid of the tensors it trains in each
QAT_FILE_TYPES = {"Q4_0": "4 bits, symmetric, blocks of 32", "Q4_K_S": "Q4_K: super-blocks of 256, 6-bit sub-block scales",
                  "Q4_K_M": "Q4_K: super-blocks of 256, 6-bit sub-block scales"}


class QATWeights(_Targeted):
    """Quantization-aware training of the decoder layers' Linear weights on the calibration text:
    each layer trained to reproduce the float layer's outputs through the grid its exports store,
    starting from round-to-nearest's or GPTQ's grid, then (``e2e_steps``) the scales and norms of
    the whole model against the original's next-token distribution (quant/qat.py). The grid is
    integer (``bits``, ``symmetric``, ``group_size``), or a GGUF file type's (``gguf``): Q4_0
    (blocks of 32, symmetric 4-bit) or the Q4_K tensors of Q4_K_S and Q4_K_M (super-blocks of
    256 with 6-bit sub-block scales, starting from llama.cpp's own), written into the file as
    trained."""

    method: Literal["qat"]
    bits: int | None = Field(default=None, ge=2, le=8)
    symmetric: bool = False
    group_size: int | None = Field(default=128, ge=1)  # null: one scale per output channel
    gguf: Literal[tuple(QAT_FILE_TYPES)] | None = None  # type: ignore[valid-type]
    init: Literal["rtn", "gptq"] = "rtn"
    steps: int = Field(default=200, ge=1, le=1_000_000)  # per decoder layer
    lr: float = Field(default=0.02, gt=0, le=1)  # in steps of the grid per optimizer step
    batch: int = Field(default=2, ge=1)  # calibration windows per micro-batch
    accumulate: int = Field(default=1, ge=1, le=1024)  # micro-batches per optimizer step
    learn_scales: bool = True
    e2e_steps: int = Field(default=E2E_STEPS, ge=0, le=1_000_000)  # end to end, after the layers (0: none)
    e2e_lr: float = Field(default=1e-3, gt=0, le=1)  # relative to each scale, per optimizer step
    calibrated: ClassVar[bool] = True

    @model_validator(mode="after")
    def _one_grid(self) -> "QATWeights":
        if self.gguf is None and self.bits is None:
            raise ValueError("bits is required (or gguf: " + " | ".join(QAT_FILE_TYPES) + ")")
        given = sorted(self.model_fields_set & {"bits", "symmetric", "group_size"})
        if self.gguf is not None and given:
            raise ValueError(f"gguf: {self.gguf} fixes the grid ({QAT_FILE_TYPES[self.gguf]}): leave out {', '.join(given)}")
        if self.grid == Q4_K and self.init != "rtn":
            raise ValueError(f"gguf: {self.gguf} starts from llama.cpp's own Q4_K: leave out init: {self.init}")
        return self

    @property
    def trained_type(self) -> str | None:
        """The ggml type of the tensors QAT trains in a GGUF file (None: not a GGUF grid)."""
        return None if self.gguf is None else "Q4_0" if self.gguf == "Q4_0" else Q4_K

    @property
    def grid(self) -> Grid:
        if self.gguf == "Q4_0":
            return QuantSpec(4, True, "group", 32)
        if self.gguf is not None:
            return Q4_K
        return QuantSpec(self.bits, self.symmetric, "group" if self.group_size else "channel", self.group_size)

    @property
    def spec(self) -> QuantSpec:
        """The integer grid, for the exports that store one."""
        if not isinstance(self.grid, QuantSpec):
            raise ValueError(f"gguf: {self.gguf} is not an integer grid")
        return self.grid

    @property
    def settings(self) -> QATSettings:
        return QATSettings(steps=self.steps, lr=self.lr, batch=self.batch, accumulate=self.accumulate,
                           learn_scales=self.learn_scales, init=self.init, e2e_steps=self.e2e_steps, e2e_lr=self.e2e_lr)


class GGUFWeights(_Strict):
    """Every tensor encoded as llama.cpp's quantizer would for a GGUF file type."""

    method: Literal["gguf"]
    type: Literal[tuple(FILE_TYPES)]  # type: ignore[valid-type]
    imatrix: bool = False  # weight rounding errors by an importance matrix from the calibration text

    @property
    def calibrated(self) -> bool:
        return self.imatrix


class SourceWeights(_Strict):
    """The source weights as they are: for variants that change only the KV cache."""

    method: Literal["none"]
    calibrated: ClassVar[bool] = False


class KVCache(_Strict):
    """The KV cache in a smaller type, simulated in the evaluation (quant/kv_cache.py): ``int8`` and
    ``int4`` are llama.cpp's q8_0 and q4_0 cache types, ``fp8`` vLLM's e4m3 cache without scales."""

    format: Literal["fp8", "int8", "int4"]

    @property
    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.format)


class Activations(_Strict):
    """Per-token dynamic quantization of the inputs of every Linear whose weights the variant
    quantizes (W8A8 and friends), simulated in the evaluation; SmoothQuant (α, or null for none)
    first moves the activations' outliers into the weights (quant/smoothquant.py)."""

    format: Literal["int8", "fp8"] = "int8"
    smoothquant: float | None = Field(default=0.5, ge=0, le=1)

    @property
    def spec(self) -> ActivationSpec:
        return ActivationSpec(self.format)


def _weight_only(check: Callable[[QuantSpec], None]) -> Callable[[QuantSpec, ActivationSpec | None], None]:
    def checked(spec: QuantSpec, activations: ActivationSpec | None) -> None:
        check(spec)
        if activations is not None:
            raise ValueError("quantized activations (its checkpoints are weight-only)")
    return checked


# Checkpoint exports of integer or float codes: the check of their layout (ValueError saying why
# not), and whether they hold GPTQ's act-order groups (g_idx), as their writers say.
_QUANTIZED_EXPORTS = {
    "compressed-tensors": (compressed_tensors_layout, CompressedTensorsWriter.holds_group_index),
    "gptq": (_weight_only(gptq_check_spec), GPTQWriter.holds_group_index),
    "awq": (_weight_only(awq_check_spec), AWQWriter.holds_group_index),
    "bitsandbytes": (_weight_only(bnb_check_spec), BitsAndBytesWriter.holds_group_index),
}


class Variant(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)
    weights: Annotated[Union[RTNWeights, GPTQWeights, AWQWeights, QATWeights, GGUFWeights, SourceWeights],
                       Field(discriminator="method")]
    activations: Activations | None = None
    kv_cache: KVCache | None = None
    exports: list[Literal["safetensors", "gguf", "compressed-tensors", "gptq", "awq", "bitsandbytes"]] = []

    @property
    def needs_calibration(self) -> bool:
        return self.weights.calibrated or self.activations is not None

    @model_validator(mode="after")
    def _gguf_needs_gguf_weights(self) -> "Variant":
        w = self.weights
        if "gguf" in self.exports and w.method != "gguf" and not (w.method == "qat" and w.gguf):
            raise ValueError("a gguf export needs 'weights: {method: gguf, type: ...}' (or {method: qat, gguf: Q4_0 | Q4_K_M | ...})")
        if self.weights.method == "qat" and w.gguf and any(e in _QUANTIZED_EXPORTS for e in self.exports):
            raise ValueError(f"qat weights on the {w.gguf} grid export as gguf (and safetensors)")
        return self

    @model_validator(mode="after")
    def _quantized_exports_hold_the_weights(self) -> "Variant":
        w = self.weights
        activations = self.activations.spec if self.activations else None
        for export in self.exports:
            if export not in _QUANTIZED_EXPORTS:
                continue
            check, holds_group_index = _QUANTIZED_EXPORTS[export]
            if w.method not in ("rtn", "gptq", "awq", "qat"):
                raise ValueError(f"a {export} export needs rtn, gptq, awq or qat weights, not {w.method}")
            if getattr(w, "outliers", None) is not None:
                raise ValueError(f"a {export} export cannot hold outlier columns kept in 16 bits")
            try:
                check(w.spec, activations)
            except ValueError as e:
                raise ValueError(f"a {export} export cannot hold {e}") from None
            if getattr(w, "act_order", False) and not w.static_groups and w.group_size and not holds_group_index:
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
        return self


BUNDLED_TASKS = Path(__file__).parent / "bundled" / "tasks"  # name.jsonl: the tasks shipped with quantbench


TASK_FILES = (".jsonl",)  # our task files (evalsuite/tasks.py)
LM_EVAL_FILES = (".yaml", ".yml")  # lm-eval task configs


class TaskSpec(_Strict):
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


class Evaluation(_Strict):
    text: FilePath
    window: int = Field(default=512, ge=16, le=32768)
    max_windows: int | None = Field(default=None, ge=1)
    tasks: list[Annotated[TaskSpec, BeforeValidator(_task_spec)]] = []

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        return _unique("task", tasks)


class Calibration(_Strict):
    text: FilePath  # UTF-8 text, or .jsonl with a "text" field per line
    window: int = Field(default=512, ge=16, le=32768)
    max_windows: int = Field(default=128, ge=1)  # drawn at random (with seed) from the whole text
    seed: int = Field(default=0, ge=0, le=2**63 - 1)  # what torch's generator takes


class Speed(_Strict):
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


class Budget(_Strict):
    """The quality a customer accepts (evalsuite/recommend.py): ``kld`` in nats per token, ``top1``
    agreement, ``ppl_increase`` relative to the original's perplexity, ``task_drop`` in accuracy
    points on any task; fractions or percentages (``2%``)."""

    kld: float | None = Field(default=None, ge=0)
    top1: Fraction | None = Field(default=None, le=1)
    ppl_increase: Fraction | None = None
    task_drop: Fraction | None = Field(default=None, le=1)


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


class Recipe(_Strict):
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
    """Refuse what the model's config.json refutes: a window longer than the model's context."""
    context = arch.max_context
    if not context:
        return
    for part in ("evaluation", "calibration"):
        settings = getattr(recipe, part)
        if settings is not None and settings.window > context:
            raise InputError(f"field '{part}.window': {settings.window} tokens is longer than the context of "
                             f"{recipe.model} ({context} tokens, max_position_embeddings in its config.json)")


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
