"""The two registries a new format or method is added to (docs/extending.md): what the recipe
schema offers is exactly what they hold, and each entry is consistent with itself."""

from __future__ import annotations

import typing

import pytest

from formats.quantized_folder import QuantizedFolderWriter
from formats.registry import ENGINE_EXPORTS, FORMATS, QUANT_METHODS, in_writing_order, is_folder
from recipes.methods import METHODS
from recipes.schema import Variant

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)


def test_the_recipe_exports_are_the_registered_formats():
    (literal,) = typing.get_args(Variant.model_fields["exports"].annotation)
    assert typing.get_args(literal) == tuple(FORMATS)
    assert set(QUANT_METHODS) <= {name for name, f in FORMATS.items() if f.codes}
    assert set(ENGINE_EXPORTS) <= set(FORMATS)


def test_the_recipe_weights_are_the_registered_methods():
    classes = typing.get_args(Variant.model_fields["weights"].annotation)
    assert [typing.get_args(c.model_fields["method"].annotation) for c in classes] == [(name,) for name in METHODS]


def test_folders_are_written_before_files_in_registry_order():
    assert [f.name for f in in_writing_order(["gguf", "awq", "safetensors", "gptq"])] == ["safetensors", "gptq", "awq", "gguf"]
    assert is_folder("gptq") and not is_folder("gguf") and not is_folder("modelfile")


def test_a_quantized_format_holds_act_order_groups_as_its_writer_says():
    writers = {w.export: w for w in QuantizedFolderWriter.__subclasses__()}
    for fmt in FORMATS.values():
        if fmt.codes:
            assert fmt.holds_group_index == writers[fmt.name].holds_group_index, fmt.name
