"""Every dataset reader, by name: importing this module registers each reader module below."""

from __future__ import annotations

from pipeline.common.schema import DataError
from pipeline.datasets.readers import hmnet, qmsum, samsum
from pipeline.datasets.readers.registry import DATASETS, DatasetSpec

# The datasets' order (params ingest.datasets, the default of IngestConfig.datasets): their reader modules', in this
# order, whichever module was imported first.
READERS = (qmsum, samsum, hmnet)


def dataset_names() -> list[str]:
    """Every registered dataset, in the order of ``READERS`` (one registered later comes last)."""
    rank = {module.__name__: i for i, module in enumerate(READERS)}
    return sorted(DATASETS, key=lambda name: rank.get(DATASETS[name].read.__module__, len(rank)))


def dataset_spec(dataset: str) -> DatasetSpec:
    """``dataset``'s registration, looked up at call time: a reader module imported later (a dataset tried out before
    it joins the imports above) registers into DATASETS too."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; allowed: {sorted(DATASETS)}")
    return DATASETS[dataset]
