"""Wall time and peak memory of a stage, written to ``reports/timing/<stage>.json``.

Every stage wraps its ``main()`` body::

    with stage_timer("train"):
        ...

or decorates it (``@stage_timer("train")``). The record is written when the block finishes without an
exception (a failed stage leaves no timing behind, as DVC leaves no outputs behind). Declare the file in
dvc.yaml as an uncached metrics output of the stage: ``metrics: [reports/timing/<stage>.json: {cache: false}]``.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from pipeline.common import atomic

TIMING_DIR = Path("reports/timing")


@dataclass
class StageTiming:
    stage: str
    seconds: float
    peak_rss_mb: float
    finished_at: str  # ISO 8601, UTC


def peak_rss_mb() -> float:
    """Peak resident set size so far of this process and of its finished children, in MiB.

    ``ru_maxrss`` is the high-water mark kept by the kernel, so short peaks between samples are not missed
    (KiB on Linux, bytes on macOS). Children (e.g. Ray workers) are counted by their own peak, not summed.
    """
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) * scale / 2**20, 1)


class stage_timer(contextlib.ContextDecorator):
    """Context manager / decorator recording a stage's wall time and peak RSS.

    ``out_dir`` defaults to ``reports/timing`` relative to the working directory (DVC runs stages from the
    project root). After the block, ``.record`` holds the :class:`StageTiming` that was written.
    """

    def __init__(self, stage: str, out_dir: str | Path | None = None):
        if not stage or "/" in stage:
            raise ValueError(f"stage_timer: invalid stage name {stage!r}")
        self.stage = stage
        self.out_dir = Path(out_dir) if out_dir is not None else TIMING_DIR
        self.record: StageTiming | None = None
        self._start = 0.0

    @property
    def path(self) -> Path:
        return self.out_dir / f"{self.stage}.json"

    def __enter__(self) -> "stage_timer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.record = StageTiming(
                stage=self.stage,
                seconds=round(time.perf_counter() - self._start, 3),
                peak_rss_mb=peak_rss_mb(),
                finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic.write_json(self.path, asdict(self.record))
        return False  # never swallow the stage's exception
