"""The two seeded subsamplers of client examples (training caps, evaluation's test subsample). They draw differently
on purpose and must stay as they are: each fixes which examples a recorded result was computed on. Both keep the
partition file's order."""
from __future__ import annotations

import random

import numpy as np


def subsample_ids(ids: list[str], limit: int | None, seed: int) -> list[str]:
    """At most ``limit`` ids, drawn without replacement with a seeded generator, in partition order."""
    if limit is None or len(ids) <= limit:
        return list(ids)
    keep = np.sort(np.random.default_rng(seed).choice(len(ids), size=limit, replace=False))
    return [ids[i] for i in keep]


def subsample_test_ids(test_ids: list[str], client: str, k: int | None, seed: int) -> list[str]:
    """At most ``k`` test ids of ``client``, drawn with a seed that depends only on (seed, client). Every method
    evaluated on the same partition therefore sees the same examples (needed for paired comparisons: case study, human
    evaluation). Order follows the partition file."""
    if k is None or k >= len(test_ids):
        return list(test_ids)
    chosen = set(random.Random(f"evaluate:{seed}:{client}").sample(sorted(test_ids), k))
    return [i for i in test_ids if i in chosen]
