"""Peak memory (RSS) and wall time of each pipeline stage, from the ``reports/timing/<stage>.json`` records that
``pipeline.common.timing.stage_timer`` writes when a stage of ``make repro`` finishes. Nothing is run here."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.common.timing import TIMING_DIR


def collect(timing_dir: Path = TIMING_DIR) -> dict:
    stages, problems = [], []
    for path in sorted(Path(timing_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            stages.append(
                {
                    "stage": str(record["stage"]),
                    "seconds": float(record["seconds"]),
                    "peak_rss_mb": float(record["peak_rss_mb"]),
                    "finished_at": record.get("finished_at"),
                    "file": str(path),
                }
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append({"file": str(path), "problem": f"{type(e).__name__}: {e}"})
    stages.sort(key=lambda r: r.get("finished_at") or "")
    out = {"timing_dir": str(timing_dir), "stages": stages, "skipped_files": problems}
    if stages:
        worst = max(stages, key=lambda r: r["peak_rss_mb"])
        out["max_peak_rss_mb"] = worst["peak_rss_mb"]
        out["max_peak_rss_stage"] = worst["stage"]
        out["total_seconds"] = round(sum(r["seconds"] for r in stages), 1)
    return out
