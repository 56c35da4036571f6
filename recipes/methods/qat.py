"""Quantization-aware training, layer by layer on the calibration text (quant/qat.py): its
weights land on the grid its exports store, and each Linear's output error comes with them.

With ``gguf: Q4_0`` the grid is Q4_0's (blocks of 32, one fp16 scale, levels 0..15 around 8); with
``gguf: Q4_K_M`` or ``Q4_K_S`` it is Q4_K's for the tensors llama.cpp gives that type in such a
file. The variant's tensors are planned as llama.cpp plans the file, and the trained blocks are
written into it as they are; the tensors QAT does not train (Q6_K ones, say) are encoded as
llama.cpp would.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from core.schemes import QuantSpec
from core.tensors import GGMLTensor, LayerResult, QuantizedTensor
from quant.ggml.legacy import q4_0_from_levels
from quant.qat import E2E_STEPS, Q4_K, Grid, QATSettings, qat_model
from recipes.fields import Targeted
from recipes.methods import Plan, WeightMethod, chosen_modules, finite, gguf_encode, gguf_plan, grid_plan, register


# the GGUF file types QAT trains for, and the grid of the tensors it trains in each
QAT_FILE_TYPES = {"Q4_0": "4 bits, symmetric, blocks of 32", "Q4_K_S": "Q4_K: super-blocks of 256, 6-bit sub-block scales",
                  "Q4_K_M": "Q4_K: super-blocks of 256, 6-bit sub-block scales"}


class QATWeights(Targeted):
    """Quantization-aware training of the decoder layers' Linear weights on the calibration text:
    each layer trained to reproduce the float layer's outputs through the grid its exports store,
    starting from round-to-nearest's or GPTQ's grid and guided by a ``holdout`` share of the windows
    it does not train on (the grid best there is kept, and a layer stops once it stops improving;
    with ``keep_gptq``, the better of GPTQ's two solutions where it is better there than the grid trained from RTN),
    then (``e2e_steps``) the scales and norms of the whole model against the original's next-token distribution (quant/qat.py). The grid is
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
    keep_gptq: bool = True  # from RTN: a layer keeps the better of GPTQ's two solutions where it beats training on the held-out windows
    steps: int = Field(default=200, ge=1, le=1_000_000)  # per decoder layer
    lr: float = Field(default=0.01, gt=0, le=1)  # in steps of the grid per optimizer step
    batch: int = Field(default=2, ge=1)  # calibration windows per micro-batch
    accumulate: int = Field(default=1, ge=1, le=1024)  # micro-batches per optimizer step
    learn_scales: bool = True
    holdout: float = Field(default=0.125, ge=0, lt=1)  # share of the calibration windows that guides training
    average: float = Field(default=0.95, ge=0, lt=1)  # decay of the moving average each look also scores (0: none)
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
                           learn_scales=self.learn_scales, init=self.init, keep_gptq=self.keep_gptq, holdout=self.holdout,
                           average=self.average, e2e_steps=self.e2e_steps, e2e_lr=self.e2e_lr)


@register("qat")
class QAT(WeightMethod):
    weights = QATWeights

    def plan(self, ckpt, variant, imatrix: bool) -> Plan:
        w = variant.weights
        if w.gguf is None:
            return grid_plan(ckpt, variant)
        plan = gguf_plan(ckpt, variant, w.gguf, False)
        chosen = {f"{m}.weight" for m in chosen_modules(ckpt, w)}
        plan.quantized = {n for n in plan.names if n in chosen and plan.ggml_types[n] == w.trained_type}
        return plan

    def fits(self, weights) -> bool:
        return True

    def fit(self, ckpt, variant, windows, report=None, checkpoint=None, plan=None):
        w = variant.weights

        def on_step(phase: str, step: int, steps: int, loss: float) -> None:
            if report is not None and ((step + 1) % 10 == 0 or step + 1 == steps):
                report(f"{phase} step {step + 1}/{steps} loss {loss:.3g}")

        plan = self.plan(ckpt, variant, False)
        trained = qat_model(ckpt, windows, w.grid, w.settings, plan.modules, on_step, checkpoint)
        if w.gguf is None:
            return trained
        # the trained blocks as they are; the rest (norms the end-to-end phase trained, weights of
        # other types) encoded in the file's own types
        return (LayerResult({n: _gguf(plan, n, t) for n, t in layer.tensors.items()}, layer.statistics, layer.errors)
                for layer in trained)

    def quantize(self, ckpt, variant, plan, name, tensor, imatrix):
        if variant.weights.gguf is None:
            return finite(ckpt, name, tensor)
        return gguf_encode(plan, name, tensor, None)

    def gguf_type(self, weights) -> str | None:
        return weights.gguf

    def describe(self, weights) -> str:
        grid = weights.gguf or weights.spec.label
        e2e = f" + {weights.e2e_steps} end to end" if weights.e2e_steps else ""
        return f"qat {grid} from {weights.init}, {weights.steps} steps{e2e}"


def _gguf(plan, name: str, tensor) -> GGMLTensor:
    if isinstance(tensor, QuantizedTensor):  # on Q4_0's grid
        return GGMLTensor("Q4_0", q4_0_from_levels(tensor.codes.numpy(), tensor.scales.numpy()), tensor.shape)
    if isinstance(tensor, GGMLTensor):  # trained on Q4_K's
        return tensor
    return gguf_encode(plan, name, tensor, None)
