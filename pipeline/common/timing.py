"""Wall time and peak memory of a stage, written to ``reports/timing/<stage>.json`` when its block (``with
stage_timer("train"):``, or ``@stage_timer("train")``) finishes without an exception: a failed stage leaves no timing
behind, as DVC leaves no outputs behind. dvc.yaml declares the file as an uncached output of the stage."""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

from pipeline.common import atomic

TIMING_DIR = Path("reports/timing")


def peak_rss_mb() -> float:
    """Peak resident set size so far of this process and of its finished children (e.g. Ray workers, each by its own
    peak), in MiB. ``ru_maxrss`` is the kernel's high-water mark, so short peaks between samples are not missed
    (KiB on Linux, bytes on macOS)."""
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) * scale / 2**20, 1)


class stage_timer(contextlib.ContextDecorator):
    """Records a stage's wall time and peak RSS in ``out_dir`` (relative to the project root DVC runs stages from);
    after the block ``.record`` holds what was written."""

    def __init__(self, stage: str, out_dir: str | Path = TIMING_DIR):
        if not stage or "/" in stage:
            raise ValueError(f"stage_timer: invalid stage name {stage!r}")
        self.stage, self.out_dir, self.record = stage, Path(out_dir), None

    def __enter__(self) -> stage_timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.record = SimpleNamespace(stage=self.stage, seconds=round(time.perf_counter() - self._start, 3),
                                          peak_rss_mb=peak_rss_mb(),
                                          finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            atomic.write_json(self.out_dir / f"{self.stage}.json", vars(self.record))
        return False  # never swallow the stage's exception
