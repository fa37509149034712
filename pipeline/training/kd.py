"""What the local loss distils, per the plan's method: the KD configuration (pipeline.modeling.losses.KDConfig)
and, for hard KD, the masks of the target nouns and verbs (stage `postag`'s file)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pipeline.datasets.postags import NounVerbMasks
from pipeline.experiments import Plan


def kd_config(plan: Plan):
    """The loss configuration of the plan's method (pipeline.modeling.losses.KDConfig)."""
    from pipeline.modeling.losses import KDConfig

    t = plan.train
    mode = plan.spec.kd_mode
    return KDConfig(
        mode=mode,
        kd_lambda=t.kd_lambda,
        tau=plan.tau if plan.tau is not None else float("inf"),
        kd_temperature=t.kd_temperature,
        kd_direction=t.kd_direction,
        entropy_log_base=t.entropy_log_base,
        tau_scale=t.tau_scale,
        kd_gate=t.kd_gate,
        loss_normalisation=t.loss_normalisation,
    )


@lru_cache(maxsize=2)
def _noun_verb_masks(path: str, mtime: float) -> NounVerbMasks:
    return NounVerbMasks.from_parquet(path)


def noun_verb_masks(postags_path: str | Path) -> NounVerbMasks:
    """The hard-KD masks of stage `postag` (pipeline.datasets.postags.NounVerbMasks), read once per process and
    file version, not per batch."""
    p = Path(postags_path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: POS tags not found (stage `postag`); method hardkd needs them")
    return _noun_verb_masks(str(p), p.stat().st_mtime)
