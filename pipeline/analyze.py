"""Stage ``analyze``: why selective KD works (METHOD.md section 7 items 6, 9, 10; what it computes:
docs/experiments.md, where it writes: docs/ARCHITECTURE.md).

What it computes and how: pipeline.results.analysis.
"""

from __future__ import annotations

import argparse

from pipeline.common import cli
from pipeline.common.timing import stage_timer
from pipeline.paths import PATHS
from pipeline.planning import declared
from pipeline.results.analysis import Analysis, AnalyzeConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_params(ap)
    args = ap.parse_args(argv)
    with stage_timer("analyze"):  # wall time, peak RSS -> reports/timing/
        params, cfg = cli.read_params(args.params, analyze=AnalyzeConfig)
        result = Analysis(cfg, declared(params, args.params), PATHS, args.params).run()
        for client, rec in result["clients"].items():
            p, r = rec["paper_kd_usage_ratio"], rec["kd_usage_ratio"]  # r null: no word update in rounds 1..best
            paper_text = f" (paper {100 * p:.0f} %)" if p is not None else ""
            usage = f"{100 * r:.1f} %" if r is not None else "undefined (no word update in 1..best)"
            print(f"analyze: {client}: KD usage {usage}{paper_text}")
        if result["missing"]:
            print(f"analyze: {result['n_missing']} input file(s) missing, left out (listed in kd_analysis.json):")
            for m in result["missing"]:
                print(f"  {m['experiment']}: {m['file']} ({m['needed_for']})")


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
