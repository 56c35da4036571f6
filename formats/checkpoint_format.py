"""What an export format is to the rest of quantbench: one small object per format (its module
holds it beside its writer and reader), listed in formats/registry.py. The recipe schema checks
a variant's exports with it, the variant builder opens its writer and names its files through
it, and the quantized-checkpoint reader reads its ``quantization_config`` back through it, so no
caller keeps a chain of ``if export == ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from core.schemes import ActivationSpec, QuantSpec
from core.tensors import TensorPayload

if TYPE_CHECKING:  # hf.py holds the dense format, so it imports this module
    from formats.hf import HFCheckpoint
    from formats.outputs import Outputs
    from formats.quantized_layout import QuantizedLayout


@dataclass(frozen=True)
class ExportContents:
    """What one variant's exports hold, whatever their format; each writer takes what it needs."""

    source: HFCheckpoint
    names: list[str]  # every tensor, in the order the writers receive them
    quantized: set[str] = field(default_factory=set)  # the weights stored as codes on ``spec``'s grid
    ggml_types: dict[str, str] = field(default_factory=dict)  # each tensor's ggml type, for GGUF
    spec: QuantSpec | None = None  # the weights' grid; None when no export stores codes
    specs: dict[str, QuantSpec] = field(default_factory=dict)  # weights on a grid of their own (bits auto), by name
    activations: ActivationSpec | None = None  # W8A8's quantized inputs, for the formats that record them
    act_order: bool = False  # fitted by GPTQ with act-order
    static_groups: bool = False  # ... keeping groups of consecutive columns (no ``g_idx``)
    settings: dict = field(default_factory=dict)  # how the weights were fitted, for a config's record
    file_type: str | None = None  # the GGUF file type the weights are encoded for


class Writer(Protocol):
    """Every export writer: tensors added one at a time in ``ExportContents.names`` order."""

    def add(self, name: str, payload: TensorPayload) -> None: ...

    def finish(self) -> Path: ...

    def abort(self) -> None: ...


class CheckpointFormat:
    """One export format. Subclasses set the class attributes and ``writer``; a quantized
    checkpoint format also ``check``s a grid and ``read``s its config back."""

    name: str  # the recipe's export name, and the folder's name inside a variant's folder
    folder = True  # a checkpoint folder (False: one file)
    dense = False  # takes the weights dequantized to float32, not their payloads
    codes = False  # stores weights as codes on a QuantSpec grid, which ``check`` must accept
    ggml = False  # stores ggml blocks: the weights must be encoded for a GGUF file type
    holds_group_index = False  # whether GPTQ's act-order groups (g_idx) have a form in it
    mixes_grids = False  # whether one checkpoint holds Linears on different grids (``bits: auto``)
    readable = ""  # which of its configs ``read`` takes, for the message that lists the readers

    def check(self, spec: QuantSpec, activations: ActivationSpec | None) -> None:
        """ValueError saying why no layout of this format holds ``spec`` (with ``activations``)."""

    def file_name(self, model: str, file_type: str | None) -> str:
        """The name of what it writes inside a variant's folder, for the model folder named
        ``model`` and weights encoded for the GGUF ``file_type`` (if any)."""
        return self.name

    def files(self, path: Path, file_type: str | None = None) -> dict[str, Path]:
        """Every path it writes when its export goes to ``path``, by key (its name for ``path``),
        for weights encoded for the GGUF ``file_type`` (if any)."""
        return {self.name: path}

    def open(self, outputs: Outputs, paths: dict[str, Path], contents: ExportContents) -> Writer:
        """Stage its outputs (``paths``: the variant's, by ``files`` key) in ``outputs`` and
        open its writer there."""
        return self.writer(outputs.stage(paths[self.name]), contents)

    def writer(self, dest: Path, contents: ExportContents) -> Writer:
        """Its writer at ``dest`` (a staged path), for what ``contents`` holds."""
        raise NotImplementedError

    def read(self, config: dict, raw: HFCheckpoint) -> QuantizedLayout:
        """The layout a ``quantization_config`` of this format describes; ValueError (or KeyError,
        TypeError) for one this reader does not take."""
        raise NotImplementedError(f"{self.name} checkpoints are not read as quantized folders")


def weight_only(check_spec: Callable[[QuantSpec], None], spec: QuantSpec, activations: ActivationSpec | None) -> None:
    """``check_spec(spec)`` for formats whose checkpoints store no activation quantization."""
    check_spec(spec)
    if activations is not None:
        raise ValueError("quantized activations (its checkpoints are weight-only)")
