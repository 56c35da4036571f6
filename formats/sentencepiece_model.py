"""SentencePiece model files (``tokenizer.model``) read without the sentencepiece library.

GGUF export of Llama-2-style checkpoints embeds the SentencePiece vocabulary (pieces, scores and
types, which llama.cpp's SPM tokenizer merges by) and whether the model prepends a space. That is
three fields of a protobuf message (sentencepiece_model.proto, ``ModelProto``), whose wire format
is simple to walk, so the export needs no extra dependency and never runs a parser it cannot
bound: every length is checked against the bytes that are there.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from core.errors import InputError

# ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# TrainerSpec.ModelType
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


@dataclass(frozen=True)
class SentencePieceModel:
    pieces: list[tuple[str, float, int]]  # (piece, score, type) by token id
    model_type: str
    add_dummy_prefix: bool  # the normalizer prepends "▁" to the text


def read_sentencepiece(path: Path) -> SentencePieceModel:
    """The vocabulary and the two settings GGUF needs from a ``tokenizer.model`` file."""
    try:
        fields = _fields(path.read_bytes())
        pieces = [_piece(body) for number, body in fields if number == 1]
        trainer = _fields(next((body for number, body in fields if number == 2), b""))
        normalizer = _fields(next((body for number, body in fields if number == 3), b""))
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise InputError(f"{path}: not a SentencePiece model ({e})") from None
    if not pieces:
        raise InputError(f"{path}: not a SentencePiece model (no pieces)")
    model_type = MODEL_TYPES.get(_last(trainer, 3, 1), "unknown")
    return SentencePieceModel(pieces, model_type, bool(_last(normalizer, 3, 1)))


def _piece(body: bytes) -> tuple[str, float, int]:
    fields = _fields(body)
    text = next((value for number, value in fields if number == 1), b"")
    return text.decode("utf-8"), float(_last(fields, 2, 0.0)), int(_last(fields, 3, NORMAL))


def _last(fields: list[tuple[int, object]], number: int, default):
    """A scalar field's value: protobuf lets the last occurrence win; absent means the default."""
    values = [value for n, value in fields if n == number]
    return values[-1] if values else default


def _fields(data: bytes) -> list[tuple[int, object]]:
    """One message's fields as (number, value): ints for varints, floats for 32-bit fields (every
    32-bit field in these messages is a float), bytes for length-delimited ones."""
    out = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<d", data, pos)[0], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise ValueError("a field runs past the end of the file")
            value, pos = data[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = struct.unpack_from("<f", data, pos)[0], pos + 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        out.append((number, value))
    return out


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos
