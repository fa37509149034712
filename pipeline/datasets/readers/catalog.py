"""Every dataset reader, by name: importing this module registers each reader module below."""
from __future__ import annotations

from pipeline.common.schema import DataError
from pipeline.datasets.readers import qmsum, samsum, hmnet  # noqa: F401 (they register; this order is the datasets')
from pipeline.datasets.readers.registry import DATASETS, DatasetSpec

# dataset name -> reader(directory, report, allow_absent) (params.yaml ingest.datasets names these)
READERS = {name: spec.read for name, spec in DATASETS.items()}


def dataset_spec(dataset: str) -> DatasetSpec:
    if dataset not in DATASETS:
        names = list(DATASETS)
        raise DataError(f"unknown dataset {dataset!r}; expected {', '.join(names[:-1])} or {names[-1]}")
    return DATASETS[dataset]
