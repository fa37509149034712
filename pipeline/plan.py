"""Stage `plan`: one resolved configuration per experiment, `models/plans/<experiment>.json`, holding exactly what
its result depends on (pipeline.experiments), so a params change reruns only the train stages it affects.

    python -m pipeline.plan [--params params.yaml] [--out models/plans]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.common import cli
from pipeline.common.config import load_params
from pipeline.paths import PATHS
from pipeline.planning import check_params, write_plans
from pipeline.privacy.accounting import check_client_plans


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_params(ap)
    ap.add_argument("--out", default=str(PATHS.plans))
    args = ap.parse_args(argv)
    plans = check_params(load_params(args.params), args.params)
    check_client_plans(plans, args.params)  # privacy.mode client needs only the plan's clients: checked now
    written = write_plans(plans, Path(args.out))
    print(f"plan: wrote {len(written)} plan(s) to {args.out}")


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
