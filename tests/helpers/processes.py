"""Processes a test started, found by the tag it put in their environment (children included), to
check that none is left behind."""

from __future__ import annotations

from pathlib import Path


def tagged_processes(tag: str) -> list[int]:
    """Processes whose environment carries QUANTBENCH_TEST_TAG=tag (a killed job's children included)."""
    needle = f"QUANTBENCH_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue  # gone, or a zombie
    return found
