"""Stage `ingest`: read one dataset in its upstream format into the canonical table.

    python -m pipeline.ingest --dataset qmsum      # -> data/interim/qmsum.parquet, reports/data/ingest_qmsum.json

The readers (pipeline/datasets/readers/) raise DataError naming file, line and problem; records left out by design
(an empty SAMSum dialogue or summary) are counted in the report with their reason."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from pipeline.common import atomic, cli
from pipeline.common.schema import DataError, IngestReport, canonical_arrow_schema
from pipeline.common.timing import stage_timer
from pipeline.datasets.readers.catalog import DATASETS, dataset_spec
from pipeline.datasets.sources import IngestConfig, resolve_source
from pipeline.paths import PATHS


def ingest_dataset(dataset: str, directory: Path, allow_absent: list[str] = ()) -> tuple[pd.DataFrame, IngestReport]:
    """Read ``dataset`` from ``directory`` (its upstream layout) into the canonical table. ``allow_absent``: patterns of
    ``<dataset>/<domain>/<split>`` (``ingest.allow_absent_splits``) whose split file may be missing or empty; any other
    missing or empty split is an error."""
    report = IngestReport(dataset=dataset, source=str(directory))
    records = dataset_spec(dataset).read(directory, report, allow_absent)
    rows = []
    for rec in tqdm(records, desc=f"ingest {dataset}", unit="rec", mininterval=2):
        report.count(rec)
        rows.append(dataclasses.asdict(rec))
    return pd.DataFrame(rows, columns=canonical_arrow_schema().names), report


def write_outputs(frame: pd.DataFrame, report: IngestReport, interim_dir: Path, report_dir: Path) -> None:
    atomic.to_parquet(frame, interim_dir / f"{report.dataset}.parquet", schema=canonical_arrow_schema(), index=False)
    atomic.write_json(report_dir / f"ingest_{report.dataset}.json", report.to_dict())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=tuple(DATASETS))
    cli.add_params(ap)
    ap.add_argument("--interim-dir", default=str(PATHS.interim_dir))
    ap.add_argument("--report-dir", default=str(PATHS.data_reports))
    args = ap.parse_args(argv)
    with stage_timer(f"ingest-{args.dataset}"):  # wall time, peak RSS -> reports/timing/
        _, cfg = cli.read_params(args.params, ingest=IngestConfig)
        if args.dataset not in cfg.datasets:
            raise DataError(f"dataset {args.dataset!r} is not in ingest.datasets {cfg.datasets}")
        directory = resolve_source(args.dataset, cfg)
        frame, report = ingest_dataset(args.dataset, directory, cfg.allow_absent_splits)
        write_outputs(frame, report, Path(args.interim_dir), Path(args.report_dir))
        print(
            f"{args.dataset}: {report.n_records} records from {directory}; counts {report.counts}; "
            f"skipped {len(report.skipped)}"
        )


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
