"""Shared test setup: offline, deterministic, small."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")  # else each dvc command the tests run starts a daemon to report

# Tiny models: one thread avoids oversubscribing a 2-core machine (2 threads made tiny ops 50x slower under load).
# The processes tests start inherit it (Flower's SuperLink, SuperNodes and one flwr-clientapp per message, stage CLIs).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# After the settings above: the tests run federations in-process as the train stage does, so privacy's mechanisms are
# registered as its entry point registers them (pipeline.training.privacy_hooks; tests/test_privacy_hooks.py checks the
# defaults of a process without them).
import pipeline.privacy.seam  # noqa: E402, F401

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FEDMEET_DATA_ROOT", REPO_ROOT.parent / "shared" / "data"))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """Collecting imports the suite's libraries (torch, transformers, Flower, MLflow, ...) in every xdist worker: no
    full collections over them meanwhile, nor after (frozen); ~2.4 s CPU a worker (docs/performance.md)."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of an xdist group first (tests/test_deployment.py: the long chains of Flower processes). With
    --dist loadgroup, xdist deals out work in collection order (groups of several tests before single ones): each group
    then starts on a worker of its own at once, and the CPU-bound tests fill the other workers beside the waits."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: file order otherwise


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or skip with the reason when this checkout has no shared data beside it."""
    if not (SHARED_DATA / "qmsum").is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set FEDMEET_DATA_ROOT)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _no_flower_identity():
    """Flower's Message() reads the process's task identity (flwr.supercore.task_identity), which its runtimes and
    our in-process engine set once and never clear: a test that builds messages passed or failed by which test its
    xdist worker ran before. Every test starts without one; one that plays a ServerApp asks for
    ``server_identity``."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = None  # its setters take None: unset
    yield


@pytest.fixture
def server_identity() -> int:
    """This process as a ServerApp of run 1, as Flower's runtimes (and federation.engines) set it; the run id."""
    from pipeline.federation.engines import _set_server_identity

    _set_server_identity(1)
    return 1


@pytest.fixture(params=["UTC", "Pacific/Kiritimati"])
def zone(request, monkeypatch):
    """The importing machine's time zone, UTC and UTC+14 (another date for most of a day): a lent machine's returned
    files give the same reports in any (its nvidia-smi stamps are its own clock, UTC)."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()
