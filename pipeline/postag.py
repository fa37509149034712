"""Stage ``postag``: the universal POS tag of every target token, computed once before training (METHOD.md section 7
items 9 and 10: noun-verb hard KD and the POS analysis).

How the targets are tagged: pipeline.modeling.target_tags.

    python -m pipeline.postag [--examples data/processed/examples.parquet] [--backbone models/backbone]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.common import cli
from pipeline.common.config import ConfigError, from_dict, group
from pipeline.common.timing import stage_timer
from pipeline.experiments.model import MODEL_RESULT_KEYS, ModelConfig
from pipeline.modeling.target_tags import PostagConfig, write_target_tags
from pipeline.paths import PATHS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=Path, default=PATHS.examples)
    ap.add_argument("--backbone", type=Path, default=PATHS.backbone)
    ap.add_argument("--out", type=Path, default=PATHS.postags)
    ap.add_argument("--report", type=Path, default=PATHS.data_reports / "postag.json")
    cli.add_params(ap)
    args = ap.parse_args(argv)
    with stage_timer("postag"):  # wall time, peak RSS -> reports/timing/
        params, cfg = cli.read_params(args.params, postag=PostagConfig)
        # the group's model keys (its cache keys are planning's to check)
        model = {k: v for k, v in group(params, "model", args.params).items() if k in MODEL_RESULT_KEYS}
        max_target_length = from_dict(ModelConfig, model, f"{args.params} model").max_target_length
        try:
            write_target_tags(cfg, args.examples, args.backbone, args.out, args.report, max_target_length)
        except ConfigError as e:  # a postag value the data or the machine refuses: the line names its params file
            raise ConfigError(f"{args.params} {e}") from None


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
