"""The dataset registry: per dataset, what its reader module (pipeline/datasets/readers/<layout>.py) declares about
its upstream layout (docs/ARCHITECTURE.md, "Where a common change goes": a dataset)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.schema import CanonicalRecord, IngestReport


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    read: Callable[[Path, IngestReport, list[str]], Iterator[CanonicalRecord]]  # (directory, report, allow_absent)
    # the expected files, relative to <root>/<dataset>/, in the upstream layout -> "<dataset>/<domain>/<split>"
    files: Callable[[], dict[str, str]]
    # download(base_url, target_dir, fetch(url) -> bytes, write(path, bytes), allow_absent (the split keys that may be
    # missing)): an upstream copy that is not the files one by one (e.g. one zip); None: each expected file is fetched
    # from ``base_url/<upstream_path(file)>``.
    download: Callable[[str, Path, Callable[[str], bytes], Callable[[Path, bytes], None], list[str]], None] | None = (
        None
    )
    upstream_path: Callable[[str], str] = lambda rel: rel  # expected file -> its path under the download address
    # the pinned upstream address (params ingest.urls.<name> defaults to it): the base URL of the files, or the archive
    url: str = ""


DATASETS: dict[str, DatasetSpec] = {}


def register_reader(spec: DatasetSpec) -> None:
    """Register dataset ``spec.name`` (the name params ingest.datasets uses)."""
    if spec.name in DATASETS:
        raise ValueError(f"dataset {spec.name!r} is registered twice")
    DATASETS[spec.name] = spec
