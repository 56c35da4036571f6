"""How every file quantbench writes reaches disk: checked, staged, committed together, swept, locked.

- A command's output paths are checked before any model is loaded (a file where a folder is
  needed, a folder that cannot be created or written, a name too long, a NUL byte), so a mistake
  costs a second, not an evaluation.
- Files (and folders) are written under a temporary name beside their final one,
  ``NAME.<pid>.partial``, and moved into place by ``Outputs.commit`` only once everything the
  command makes has been written; on any failure ``Outputs`` removes them. The pid keeps two
  writers of the same path apart and tells a later run whether the writer of a leftover is alive.
- A process killed with SIGKILL cleans nothing up: staging a path removes that path's leftovers
  whose writer is dead, and a recipe job removes every such leftover in its folder.
- A recipe job holds an exclusive lock on its output folder (``flock`` on ``.quantbench.lock``).
  The kernel drops the lock when its holder dies, however it dies, so a lock left by a killed job
  is stale by construction and simply taken over; a second live job is refused with the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from core.errors import InputError

LOCK = ".quantbench.lock"
_PARTIAL = re.compile(r"\.(\d+)\.partial$")
_SUFFIX_ROOM = len(".4194304.partial")  # the longest temporary suffix (Linux pids stay below 2**22)


class Outputs:
    """The files one command (or one variant of a recipe job) writes, staged until ``commit``.

    ``stage(final)`` gives the temporary path to write instead, creating the folders above it;
    ``commit()`` renames every staged path to its final name, in staging order (a folder replaces
    the folder of the same name); leaving the ``with`` block without ``commit`` removes them all,
    and the folders ``stage`` created if they are left empty."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []
        self._made: list[Path] = []

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()

    def stage(self, final: Path) -> Path:
        missing = [p for p in (final.parent, *final.parent.parents) if not p.exists()]
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"{final.parent}: cannot create the folder ({e.strerror or e})") from None
        self._made += reversed(missing)
        _remove_dead_partials(final)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.partial")
        _remove(tmp)
        self._staged.append((tmp, final))
        return tmp

    def staged(self, final: Path) -> Path:
        """Where ``final`` is being written until ``commit``: what a reader of the files before
        then (the engine, scoring a variant) opens."""
        return next(tmp for tmp, f in self._staged if f == final)

    def commit(self) -> None:
        for tmp, final in self._staged:
            if tmp.is_dir() and final.is_dir():
                shutil.rmtree(final)
            os.replace(tmp, final)
        self._staged.clear()
        self._made.clear()

    def discard(self) -> None:
        for tmp, _ in self._staged:
            _remove(tmp)
        self._staged.clear()
        for folder in reversed(self._made):  # innermost first
            try:
                folder.rmdir()
            except OSError:
                pass  # not empty (or gone): someone else's now
        self._made.clear()


def check_output_path(path: Path, *, folder: bool) -> None:
    """Refuse an output path that cannot be written, before any work: a NUL byte, a name or path
    too long for the file system (with room for the temporary suffix), a file where a folder is
    needed or a folder where a file is, and a nearest existing parent that is a file or not
    writable."""
    text = os.fspath(path)
    if "\0" in text:
        raise InputError(f"{text}: a path cannot hold a NUL byte")
    ancestor = path if folder and path.is_dir() else path.parent  # where the first new entry goes
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        name_max, path_max = (os.pathconf(ancestor, key) for key in ("PC_NAME_MAX", "PC_PATH_MAX"))
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        if len(os.fsencode(part)) + _SUFFIX_ROOM > name_max:
            raise InputError(f"{path}: the name '{part[:40]}...' is {len(os.fsencode(part))} bytes; this file system "
                             f"takes {name_max - _SUFFIX_ROOM} at most here (with room for '.<pid>.partial')")
    if len(os.fsencode(os.path.abspath(text))) + _SUFFIX_ROOM >= path_max:
        raise InputError(f"{path}: the path is too long for this file system ({path_max} bytes at most)")
    if path.exists():
        if folder and not path.is_dir():
            raise InputError(f"{path}: exists and is a file; the output must be a folder")
        if not folder and path.is_dir():
            raise InputError(f"{path}: is a folder; the output must be a file name")
    if not ancestor.is_dir():
        raise InputError(f"{path}: {ancestor} is a file, so nothing can be created under it")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"{path}: {ancestor} is not writable")


@contextmanager
def folder_lock(folder: Path) -> Iterator[dict | None]:
    """Hold ``folder`` (created if missing) for one job; yields what the lock file said of a
    previous holder that died without releasing it (None if there was none). Inside, every
    leftover ``.partial`` of a dead writer in the folder has been removed. On leaving, the lock
    file goes, and the folder too if this job created it and left nothing in it."""
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{folder}: cannot create the output folder ({e.strerror or e})") from None
    lock = folder / LOCK
    fd = _acquire(lock, folder)
    try:
        previous = os.read(fd, 4096)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.write(fd, json.dumps(holder).encode())
        for leftover in folder.rglob("*.partial"):
            if not _writer_alive(leftover):
                _remove(leftover)
        yield _parse_holder(previous)
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)  # releases the flock
        if created:
            try:
                folder.rmdir()
            except OSError:
                pass


def _acquire(lock: Path, folder: Path) -> int:
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise InputError(f"{folder}: cannot write in the output folder ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_holder(os.read(fd, 4096))
            os.close(fd)
            who = f"pid {holder['pid']} on {holder['host']}, since {holder['since']}" if holder else "another process"
            raise InputError(f"{folder}: another quantize job is writing this folder ({who}); "
                             "wait for it to finish or choose another output folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder released and removed the file between our open and flock: again


def _parse_holder(raw: bytes) -> dict | None:
    try:
        holder = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) and {"pid", "host", "since"} <= holder.keys() else None


def _writer_alive(partial: Path) -> bool:
    """Whether the process named in a ``NAME.<pid>.partial`` still runs (a name without a pid, from
    an older quantbench, has no live writer)."""
    m = _PARTIAL.search(partial.name)
    if not m:
        return False
    pid = int(m.group(1))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove_dead_partials(final: Path) -> None:
    """Remove the leftovers of earlier writers of ``final`` that are no longer running."""
    leftover = re.compile(re.escape(final.name) + r"(\.\d+)?\.partial")
    try:
        siblings = list(final.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        if leftover.fullmatch(p.name) and not _writer_alive(p):
            _remove(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
