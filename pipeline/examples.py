"""Stage `examples`: canonical records -> model inputs, and the data statistics of the paper's Table II.

    python -m pipeline.examples      # -> data/processed/examples.parquet, reports/data/stats.{json,md}

How the model inputs are made: pipeline.datasets.examples."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.common import atomic, cli
from pipeline.common.config import ConfigError, group
from pipeline.common.schema import DataError, canonical_arrow_schema, read_json, read_parquet
from pipeline.common.timing import stage_timer
from pipeline.datasets.examples import ExamplesConfig, build_examples, stats_markdown, table_ii
from pipeline.paths import PATHS

# the columns of the ingest tables build_examples reads (not the spans, nor the source's file and line)
INTERIM_COLUMNS = ("domain", "split", "meeting_id", "query_index", "query", "query_type", "turns", "summary")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_params(ap)
    ap.add_argument("--interim-dir", type=Path, default=PATHS.interim_dir)
    ap.add_argument("--report-dir", type=Path, default=PATHS.data_reports)
    ap.add_argument("--out", default=str(PATHS.examples))
    args = ap.parse_args(argv)
    with stage_timer("examples"):  # wall time, peak RSS -> reports/timing/
        params, cfg = cli.read_params(args.params, examples=ExamplesConfig)
        # The names only (the ingest stage checked them against the readers): reading them through
        # pipeline.datasets.sources would put every reader module into this stage's deps, and the backbone's.
        datasets = group(params, "ingest", args.params).get("datasets")
        if not (isinstance(datasets, list) and datasets and all(isinstance(d, str) for d in datasets)):  # 1 or more
            raise ConfigError(f"{args.params} ingest.datasets: expected a list of dataset names, got {datasets!r}")
        read = [col for col in canonical_arrow_schema() if col.name in INTERIM_COLUMNS]
        interim = {ds: read_parquet(args.interim_dir / f"{ds}.parquet", "ingest table", read) for ds in datasets}
        examples, link_report = build_examples(interim, cfg)
        skipped = {}  # dataset -> reason -> count
        for ds in datasets:
            path = args.report_dir / f"ingest_{ds}.json"
            if not isinstance(by := read_json(path, "ingest report").get("skipped_by_reason"), dict):
                raise DataError(f"{path}: ingest report without its skipped_by_reason object")
            skipped[ds] = by
        stats = table_ii(examples)
        # before any write: a stage that stops writes nothing
        markdown = stats_markdown(stats, skipped, link_report, cfg.qmsum_query_types)
        atomic.to_parquet(examples, args.out, index=False)
        atomic.write_json(args.report_dir / "stats.json", {**stats, "skipped": skipped, "meeting_links": link_report})
        atomic.write_text(args.report_dir / "stats.md", markdown)
        print(f"{len(examples)} examples -> {args.out}")


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
