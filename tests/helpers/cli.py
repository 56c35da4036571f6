"""Run the `quantize` command in-process and check its refusals: exit status 2, one line."""

from __future__ import annotations

import sys

from recipes.cli import main


def quantize(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["quantize", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(result, *fragments: str) -> None:
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err + out
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
