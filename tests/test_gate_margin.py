"""The one-file KD gate extension, shown on the probability-margin gate (pipeline/modeling/gates/margin.py): which
tokens it distils and the loss they get, against hand-computed values; its plan key."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.common.config import ConfigError, load_params
from pipeline.modeling.losses import KDConfig, distillation_loss
from tests.test_losses import n_kd

ROOT = Path(__file__).resolve().parents[1]
# Teacher distributions of three target tokens over a 3-word vocabulary; margins top-1 - top-2: 0.5, 0.05, 0.0
TEACHER = [[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.45, 0.1, 0.45]]


def _loss(tau: float, lam: float = 0.2):
    teacher = torch.tensor(TEACHER).log().unsqueeze(0)  # logits whose softmax is TEACHER
    student = torch.zeros(1, 3, 3, requires_grad=True)  # uniform q_l
    labels = torch.tensor([[0, 1, 2]])
    return distillation_loss(
        student, teacher, labels, KDConfig(mode="selective", kd_gate="margin", tau=tau, kd_lambda=lam)
    )


def test_the_margin_gate_distils_where_the_teacher_clearly_prefers_one_word():
    out = _loss(0.3)
    assert out.gate_rows.tolist() == [True, False, False] and n_kd(out) == 1 and out.threshold == pytest.approx(0.3)
    # uniform student: CE = ln 3 on every token; KL(q_g || q_l) = ln 3 - H(q_g) on the distilled one
    h = -sum(p * math.log(p) for p in TEACHER[0])
    kl = math.log(3) - h
    expected = ((1 - 0.2) * math.log(3) + 0.2 * kl + math.log(3) + math.log(3)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert float(out.means(n_kd(out))[2]) == pytest.approx(kl, rel=1e-6)
    assert _loss(0.04).gate_rows.tolist() == [True, True, False]  # 0.05 >= 0.04; a tie at the top has margin 0
    assert n_kd(_loss(0.6)) == 0


def test_the_margin_gate_reads_a_probability_margin():
    with pytest.raises(ConfigError) as err:
        _loss(5.0)
    assert str(err.value) == "KDConfig: MarginSettings.tau=5.0 is out of range; allowed: > 0 and <= 1"


@pytest.mark.parametrize("tau", [1.5, 5.0])
def test_a_margin_outside_0_1_fails_at_planning_naming_the_experiment(tmp_path, tau):
    from pipeline.planning import check_params, write_plans

    params = copy.deepcopy(load_params(ROOT / "params.yaml"))
    params["experiments"] = {
        "margin-domain": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "tau": tau},
    }
    params["train"]["kd_gate"] = "margin"
    with pytest.raises(ConfigError) as err:
        write_plans(check_params(params), tmp_path)
    assert "experiments.margin-domain" in str(err.value) and f"tau={tau}" in str(err.value)
    assert not list(tmp_path.glob("*.json"))  # no plan written
    params["experiments"]["margin-domain"]["tau"] = 1.0  # the bound itself is a margin
    assert [p.name for p in write_plans(check_params(params), tmp_path)] == ["margin-domain.json"]


def test_an_experiment_choosing_it_has_it_in_its_plan_and_no_other_plan_changes(tmp_path):
    from pipeline.experiments.plans import read_plan
    from pipeline.planning import check_params, write_plans
    from pipeline.training.client_training import kd_config

    params = copy.deepcopy(load_params(ROOT / "params.yaml"))
    before = {p.name: p.read_text() for p in write_plans(check_params(params), tmp_path / "a")}
    params["experiments"]["margin-domain"] = {
        "method": "fedselectkd",
        "partition": "domain/seed0",
        "seed": 0,
        "study": "gates",
        "tau": 0.5,
        "kd_gate": "margin",
    }
    after = {p.name: p.read_text() for p in write_plans(check_params(params), tmp_path / "b")}
    assert {n: t for n, t in after.items() if n != "margin-domain.json"} == before
    assert json.loads(after["margin-domain.json"])["train"]["kd_gate"] == "margin"
    cfg = kd_config(read_plan(tmp_path / "b" / "margin-domain.json"))
    assert (cfg.mode, cfg.kd_gate, cfg.tau) == ("selective", "margin", 0.5)


def test_a_gate_name_registers_once_with_its_settings(monkeypatch):
    """The KD gate registry's guard rail (pipeline/modeling/gates/registry.py): a second gate under a taken name is
    refused and the first stands; a new one is registered with the class that checks its tau."""
    from pipeline.modeling.gates.catalog import GATES
    from pipeline.modeling.gates.registry import GATE_SETTINGS, register_gate

    def gate(rows, cfg):
        return rows.entropy < 0, float("nan")

    first = GATES["entropy"]
    with pytest.raises(ValueError, match="KD gate 'entropy' is registered twice"):
        register_gate("entropy")(gate)
    assert GATES["entropy"] is first
    for registry in (GATES, GATE_SETTINGS):  # so that the registration below is undone after the test
        monkeypatch.setitem(registry, "never", None)
        del registry["never"]
    assert register_gate("never", settings=int)(gate) is gate
    assert GATES["never"] is gate and GATE_SETTINGS["never"] is int
