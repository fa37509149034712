"""Wall time and peak memory of a stage, written to ``reports/timing/<stage>.json`` when its block (``with
stage_timer("train"):``, or ``@stage_timer("train")``) finishes without an exception: a failed stage leaves no timing
behind, as DVC leaves no outputs behind. dvc.yaml declares the file as an uncached output of the stage."""

from __future__ import annotations

import contextlib
import hashlib
import resource
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psutil

from pipeline.common import atomic

TIMING_DIR = Path("reports/timing")


def peak_rss_mb() -> float:
    """Peak resident set size so far of this process and of its finished children (e.g. SuperNode processes, each by
    its own peak), in MiB. ``ru_maxrss`` is the kernel's high-water mark, so short peaks between samples are not missed
    (KiB on Linux, bytes on macOS)."""
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return round(peak * scale / 2**20, 1)


def stage_name(stage: str, names: list[str]) -> str:
    """The timing record's name of ``stage`` run for ``names`` (experiments): ``<stage>-<name>`` for one, else
    ``<stage>-set-of-<n>-<digest of the names>`` (30 names joined exceed a file name's 255 bytes)."""
    if len(names) == 1:
        return f"{stage}-{names[0]}"
    return f"{stage}-set-of-{len(names)}-{hashlib.sha256('+'.join(names).encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def stage_timer(stage: str, out_dir: str | Path = TIMING_DIR, **extra: object) -> Iterator[None]:
    """Records a stage's wall time and peak RSS in ``out_dir`` (relative to the project root DVC runs stages from),
    with ``extra``'s items."""
    # What the process spent before the stage's work (interpreter, imports, argument parsing): the start-up a first
    # `make repro` pays once per stage process.
    startup = time.time() - psutil.Process().create_time()
    start = time.perf_counter()
    yield  # the stage's exception propagates from here: no record
    atomic.write_json(
        Path(out_dir) / f"{stage}.json",
        {
            "stage": stage,
            "seconds": round(time.perf_counter() - start, 3),
            "startup_seconds": round(startup, 2),
            "peak_rss_mb": peak_rss_mb(),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            **extra,
        },
    )
