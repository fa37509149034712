"""Packing several trainings into one process (``python -m pipeline.train --experiment A --experiment B``) does not
change a result: each experiment's adapters, rounds and metrics are those of the same experiment trained alone in
a fresh process (issue 28: "the same seed gives the same scores packed or alone").

The packed process trains selective KD, then single, then selective KD again (its outputs replace the first's),
so each engine runs after another training in the same process (inheriting its shared backbone, round-0 adapter
cache, prefix cache and RNG state): Flower's in-process server loop for selective KD, the serverless loop for
single.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.test_federated import workspace, write_plan, ws  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = {"pack-selectkd": "fedselectkd", "pack-single": "single"}
TIMING = {"seconds_per_round", "peak_rss_mb"}  # wall time and memory: the only values allowed to differ


def _train(*experiments: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    args = [a for e in experiments for a in ("--experiment", e)]
    subprocess.run(
        [sys.executable, "-m", "pipeline.train", *args, "--no-mlflow"], check=True, env=env, stdout=subprocess.DEVNULL
    )


def _outputs(name: str) -> dict:
    from safetensors.torch import load_file

    model = Path("models") / name
    adapters = {str(f.relative_to(model)): load_file(f) for f in sorted(model.glob("clients/*/adapter_*.safetensors"))}
    metrics = json.loads((model / "metrics.json").read_text())
    return {
        "adapters": adapters,
        "metrics": {k: v for k, v in metrics.items() if k not in TIMING},
        "rounds": json.loads((model / "rounds.json").read_text()),
        "gate_log": pd.read_parquet(model / "gate_log.parquet"),
    }


def _assert_same(packed: dict, alone: dict, name: str) -> None:
    assert packed["adapters"].keys() == alone["adapters"].keys() and packed["adapters"], name
    for f, tensors in alone["adapters"].items():
        assert tensors.keys() == packed["adapters"][f].keys()
        for k, t in tensors.items():
            assert torch.equal(t, packed["adapters"][f][k]), (name, f, k)
    assert packed["metrics"] == alone["metrics"], name
    assert packed["rounds"] == alone["rounds"], name
    pd.testing.assert_frame_equal(packed["gate_log"], alone["gate_log"])


@pytest.mark.slow
@pytest.mark.timeout(900)  # five tiny trainings in three fresh processes
def test_experiments_packed_in_one_process_equal_each_alone(ws):
    for name, method in EXPERIMENTS.items():
        write_plan(name, method, rounds=1)
    alone = {}
    for name in EXPERIMENTS:
        _train(name)
        alone[name] = _outputs(name)
        shutil.rmtree(Path("models") / name)
    assert len(alone["pack-selectkd"]["gate_log"]) > 0  # the KD gate ran: its log is compared too
    _train("pack-selectkd", "pack-single", "pack-selectkd")
    for name in EXPERIMENTS:
        _assert_same(_outputs(name), alone[name], f"{name} packed")
