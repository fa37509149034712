"""A client's examples: the partition file, the examples file, and the client's train/valid frames (seeded
subsampling)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.common.schema import DataError, read_json, read_parquet
from pipeline.experiments.plans import Plan
from pipeline.training.seeds import derived_seed


@lru_cache(maxsize=4)
def _read_examples(path: str, mtime: float) -> pd.DataFrame:
    columns = [pa.field(name, pa.string()) for name in ("example_id", "source", "target")]
    df = read_parquet(Path(path), "examples file (stage `examples`)", columns, every=True)  # every: a site's kit
    return df.set_index("example_id", drop=False)  # unique: the examples stage checks


def read_examples(path: str | Path) -> pd.DataFrame:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: examples file not found (stage `examples`)")
    return _read_examples(str(p.resolve()), p.stat().st_mtime)


def read_partition(path: str | Path, client: str | None = None) -> dict[str, Any]:
    p = Path(path)
    raw = read_json(p, "partition file (stage `partition`)")
    clients = raw.get("clients")
    if not (isinstance(clients, dict) and clients) or not all(  # none: no run; test ids read where present
        isinstance(s, dict) and {"train", "valid"} <= s.keys() for s in clients.values()
    ):
        raise DataError(f"{p}: no 'clients' mapping of each client to its train, valid and test ids")
    for name, splits in clients.items():  # train, valid and test lists: the partition stage writes them
        if bad := [k for k, ids in splits.items() if not isinstance(ids, list)]:
            raise DataError(f"{p}: client {name!r}: its {bad[0]} split is not a list of ids")
        if not splits["train"]:
            raise DataError(f"{p}: client {name!r} has an empty train split")
    if client is not None and client not in clients:  # a client given: the partition must hold it
        raise DataError(f"{p}: no client {client!r} (clients: {sorted(clients)})")
    return raw


@dataclass
class ClientData:
    train: pd.DataFrame
    valid: pd.DataFrame
    n_train_available: int  # before subsampling (train.weight_by: full)


def client_data(plan: Plan, client: str) -> ClientData:
    """The client's frames of ``plan``'s partition and examples, made once per process and file versions: every
    round of a run and every run of a set reads the same frames (read them, do not change them)."""
    paths, train = plan.paths, plan.train
    versions = tuple(Path(paths[k]).stat().st_mtime_ns if Path(paths[k]).exists() else None for k in FILES)
    limits = (train.max_train_examples_per_client, train.max_valid_examples_per_client)
    return _client_data(paths["partition"], paths["examples"], versions, client, limits, plan.seed)


FILES = ("partition", "examples")  # what a client's frames are read from


@lru_cache(maxsize=64)
def _client_data(
    partition_path: str,
    examples_path: str,
    versions: tuple,
    client: str,
    limits: tuple[int | None, int | None],
    seed: int,
) -> ClientData:
    partition = read_partition(partition_path, client)
    examples = read_examples(examples_path)
    splits = partition["clients"][client]
    frames = {}
    for split, limit in zip(("train", "valid"), limits):
        ids = [str(i) for i in splits[split]]
        if missing := [i for i in ids if i not in examples.index]:
            raise DataError(
                f"{partition_path}: client {client!r} {split} id {missing[0]!r} is not in "
                f"{examples_path} ({len(missing)} missing)"
            )
        # At most ``limit`` ids, drawn without replacement by a seeded generator, in partition order; the draw must
        # stay as it is (unlike evaluation's test subsample): it fixes which examples a recorded result trained on.
        if limit is not None and len(ids) > limit:
            rng = np.random.default_rng(derived_seed(seed, client, split, "subsample"))
            ids = [ids[i] for i in np.sort(rng.choice(len(ids), size=limit, replace=False))]
        frames[split] = _frame(examples_path, versions, tuple(ids))
    return ClientData(frames["train"], frames["valid"], len(splits["train"]))


@lru_cache(maxsize=64)
def _frame(examples_path: str, versions: tuple, example_ids: tuple[str, ...]) -> pd.DataFrame:
    """The examples ``example_ids``, one frame for every seed that draws them (all, without a limit)."""
    return read_examples(examples_path).loc[list(example_ids)].reset_index(drop=True)


def client_names(plan: Plan) -> list[str]:
    """The clients of the plan's partition file, in its order."""
    return list(read_partition(plan.paths["partition"])["clients"])
