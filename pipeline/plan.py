"""Stage `plan`: one resolved configuration per experiment, `models/plans/<experiment>.json`, holding exactly what
its result depends on (pipeline.experiments), so a params change reruns only the train stages it affects.

    python -m pipeline.plan [--params params.yaml] [--out models/plans]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.common.cli import run as run_cli
from pipeline.common.config import from_dict, load_params
from pipeline.experiments.privacy import PrivacyConfig
from pipeline.paths import PATHS
from pipeline.planning import check_params, write_plans
from pipeline.privacy.accounting import federation_privacy, sampled_per_round


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default=str(PATHS.plans))
    args = ap.parse_args(argv)
    params = load_params(args.params)
    for plan in check_params(params).values():  # privacy.mode client needs only the plan's clients: check it now
        if (privacy := plan.get("privacy", {})).get("mode") == "client":
            n, where = len(plan["clients"]), f"params.yaml experiments.{plan['experiment']}"
            rounds, sampled = plan["train"]["rounds"], sampled_per_round(n, plan["train"]["fraction_train"])
            federation_privacy(from_dict(PrivacyConfig, privacy, where), n, sampled, rounds, where)
    written = write_plans(params, Path(args.out))
    print(f"plan: wrote {len(written)} plan(s) to {args.out}")


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
