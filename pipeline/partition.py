"""Stage `partition`: divide the examples among federated clients, one scheme and seed per run.

    python -m pipeline.partition --scheme iid --seed 0
      -> data/partitions/iid/seed0.json, reports/partitions/iid-seed0.{json,png}

Schemes are in pipeline/partitioning/schemes.py. Every partition passes the leakage guard (no test meeting in
any train/valid set) and is checked to be disjoint and complete before it is written."""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa

from pipeline.common import atomic, cli
from pipeline.common.config import ConfigError
from pipeline.common.schema import read_parquet
from pipeline.common.timing import stage_timer
from pipeline.partitioning import partitions
from pipeline.partitioning.schemes import SCHEMES, PartitionConfig
from pipeline.paths import PATHS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", required=True, choices=sorted(SCHEMES))
    ap.add_argument("--seed", required=True, type=int)
    cli.add_params(ap)
    ap.add_argument("--examples", default=str(PATHS.examples))
    ap.add_argument("--out-dir", default=str(PATHS.partitions))
    ap.add_argument("--report-dir", default=str(PATHS.partition_reports))
    args = ap.parse_args(argv)
    with stage_timer(f"partition-{args.scheme}-seed{args.seed}"):  # wall time, peak RSS -> reports/timing/
        _, cfg = cli.read_params(args.params, partition=PartitionConfig)
        if args.seed < 0:  # numpy's generators refuse it (a traceback), as partition.seeds does
            raise ConfigError(f"--seed {args.seed} is out of range; allowed: >= 0 (as partition.seeds)")
        columns = [pa.field(name, pa.string()) for name in partitions.EXAMPLE_COLUMNS_USED]
        examples = read_parquet(Path(args.examples), "examples table", columns)
        part = partitions.make_partition(examples, args.scheme, args.seed, cfg)
        out = Path(args.out_dir) / args.scheme / f"seed{args.seed}.json"
        atomic.write_json(out, partitions.partition_json(part, args.scheme, args.seed, cfg), indent=1)
        stats = partitions.partition_stats(part, examples, args.scheme, args.seed)
        report = Path(args.report_dir) / f"{args.scheme}-seed{args.seed}"
        atomic.write_json(report.with_suffix(".json"), stats)
        partitions.plot_stats(stats, report.with_suffix(".png"))
        sizes = {n: c["sizes"] for n, c in stats["clients"].items()}
        print(f"{args.scheme} seed {args.seed}: {sizes}; excluded {len(part.excluded)}")


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
