"""Outputs written whole (docs/data.md, Reliability): a temporary name beside the file, renamed into place; a killed
run's ``.<name>.<pid>.<hex>.tmp`` is never read and the next write of that output removes it.

Fault injection for the reliability tests (never set in normal runs): ``FEDMEET_FAULT_KILL_WRITE=<glob>[@<n>]``
makes the process SIGKILL itself in the middle of its n-th (default first) atomic write whose file name matches
``<glob>``: the temporary file is cut to half its size first, as a kill during ``write()`` would leave it."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from psutil import pid_exists  # someone else's live process (EPERM) counts as alive

ENV_KILL = "FEDMEET_FAULT_KILL_WRITE"
_matching_writes = 0  # atomic writes so far whose name matches the kill pattern (this process)


def _fault_point(path: Path, tmp: Path) -> None:
    global _matching_writes
    pattern, _, nth = os.environ.get(ENV_KILL, "").partition("@")
    if not (pattern and fnmatch.fnmatchcase(path.name, pattern)):
        return
    _matching_writes += 1
    if _matching_writes == int(nth or 1):
        if tmp.exists() and tmp.stat().st_nlink == 1:  # a linked temporary (:func:`link`) is whole or absent
            os.truncate(tmp, tmp.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)


def _remove_stale(target: Path, pattern: str) -> None:
    """Remove temporaries of ``target`` left by processes that died before renaming them (a SIGKILL skips every
    cleanup): inside a DVC output directory they would otherwise be hashed as part of the output. Temporaries of
    live processes (a concurrent writer) are left alone."""
    rx = re.compile(pattern)
    for p in target.parent.iterdir():
        if (m := rx.fullmatch(p.name)) and int(m["pid"]) != os.getpid() and not pid_exists(int(m["pid"])):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on normal exit it replaces ``path``, on an exception it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # a fresh name beside it that keeps its suffix (savefig and friends infer the format from it)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{target.suffix}")
    try:
        yield tmp
        _fault_point(target, tmp)
        os.replace(tmp, target)
        stem, suffix = re.escape(target.stem), re.escape(target.suffix)
        _remove_stale(target, rf"\.{stem}\.(?P<pid>\d+)\.[0-9a-f]{{8}}\.tmp{suffix}")
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, **kwargs: Any) -> None:
    write_text(path, json.dumps(obj, indent=indent, **kwargs) + "\n")


def to_parquet(frame, path: str | os.PathLike, **kwargs: Any) -> None:
    with replacing(path) as tmp:
        frame.to_parquet(tmp, **kwargs)


def to_csv(frame, path: str | os.PathLike, **kwargs: Any) -> None:
    with replacing(path) as tmp:
        frame.to_csv(tmp, **kwargs)


def savefig(fig, path: str | os.PathLike, **kwargs: Any) -> None:
    with replacing(path) as tmp:
        fig.savefig(tmp, **kwargs)


def link(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """``path`` as a second name of the finished file ``source`` (a hard link, put in place like any write here): the
    same bytes without writing them again. A later write of either name replaces that name only."""
    with replacing(path) as tmp:
        try:
            os.link(source, tmp)
        except OSError:  # another file system, or one without hard links: the bytes are copied
            shutil.copyfile(source, tmp)


def temp_dir_for(path: str | os.PathLike) -> Path:
    """A fresh, empty temporary directory beside ``path``, to fill and then :func:`replace_dir` into place."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    return tmp


def replace_dir(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the finished directory ``tmp`` at ``path``. Two renames: a kill between them leaves the old directory
    under a ``.tmp`` name and none at ``path`` (the stage then simply reruns), never a mixture of old and new."""
    target = Path(path)
    _fault_point(target, Path(tmp) / "__none__")
    old = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.old.tmp")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    if old.exists():
        shutil.rmtree(old)
    _remove_stale(target, rf"\.{re.escape(target.name)}\.(?P<pid>\d+)\.[0-9a-f]{{8}}(\.old)?\.tmp")
