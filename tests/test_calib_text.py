"""Calibration text: jsonl records, and windows drawn from the whole text reproducibly."""

import json

import pytest
import torch

from calib.text import read_text, sample_windows, token_windows
from conftest import BUNDLED, TINY
from core.errors import InputError
from formats.hf import HFCheckpoint, load_tokenizer


def test_windows_are_drawn_from_the_whole_text_the_same_way_every_time():
    tok = load_tokenizer(HFCheckpoint.open(TINY))
    every = token_windows(tok, BUNDLED / "calib.txt", 128)
    a = sample_windows(tok, BUNDLED / "calib.txt", 128, 16, seed=0)
    assert torch.equal(a, sample_windows(tok, BUNDLED / "calib.txt", 128, 16, seed=0))
    assert not torch.equal(a, sample_windows(tok, BUNDLED / "calib.txt", 128, 16, seed=1))
    rows = [next(i for i in range(len(every)) if torch.equal(every[i], w)) for w in a]
    assert rows == sorted(set(rows)) and rows[-1] > len(every) // 2  # distinct, in order, not just the start
    assert len(sample_windows(tok, BUNDLED / "calib.txt", 128, 10**6)) == len(every)  # capped at what there is


def test_jsonl_records_are_joined_and_bad_lines_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "first record"}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    assert read_text(path) == "first record\n\nsecond"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(InputError, match=r"c.jsonl: line 2 has no string field 'text'"):
        read_text(path)


def test_a_deeply_nested_jsonl_line_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + "[" * 100000 + "]" * 100000 + "\n")
    with pytest.raises(InputError, match=r"c.jsonl: line 2 is not JSON \(nested too deeply\)"):
        read_text(path)
