"""Every dataset reader, by name: importing this module registers each reader module below."""

from __future__ import annotations

# isort: off
# They register, in this order: the datasets' (params ingest.datasets, the default of IngestConfig.datasets).
from pipeline.datasets.readers import qmsum, samsum, hmnet  # noqa: F401

# isort: on
from pipeline.common.schema import DataError
from pipeline.datasets.readers.registry import DATASETS, DatasetSpec

# A reader module imported later (a dataset tried out before it joins the imports above) registers into DATASETS
# too: every lookup reads it at call time.


def dataset_spec(dataset: str) -> DatasetSpec:
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; allowed: {sorted(DATASETS)}")
    return DATASETS[dataset]
