"""pipeline.training.privacy_hooks: a process that has not loaded pipeline.privacy runs a plan without privacy as
before, and refuses one that sets privacy instead of running it in the clear; importing privacy registers every hook."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.experiments.privacy import PrivacyConfig
from pipeline.privacy import seam
from pipeline.training.privacy_hooks import NO_PRIVACY, PRIVACY

PLAIN = SimpleNamespace(privacy=None, source="models/plans/plain.json", experiment="plain")
PRIVATE = SimpleNamespace(
    privacy=PrivacyConfig(mode="example", noise_multiplier=1.0), source="models/plans/dp.json", experiment="dp"
)


def test_without_privacy_loaded_a_plain_plan_runs_as_before():
    strategy = object()
    assert NO_PRIVACY.local_steps(PLAIN, None, [], 0, "Committee", None) is None
    assert NO_PRIVACY.client_level(PLAIN, strategy, 3) is None
    assert NO_PRIVACY.secure_aggregator(PLAIN, ["a", "b"], None, 1.0) is None
    assert NO_PRIVACY.client_train("msg", "ctx", lambda m, c: (m, c)) == ("msg", "ctx")
    assert NO_PRIVACY.dp_steps("ctx") is None
    assert NO_PRIVACY.account("ctx", SimpleNamespace(privacy=None)) == {}
    assert NO_PRIVACY.run_record(PLAIN, [], {}) == {"privacy": None}
    NO_PRIVACY.restore_dp_steps("ctx", None)


@pytest.mark.parametrize(
    "call",
    [
        lambda plan: NO_PRIVACY.local_steps(plan, None, [], 0, "Committee", None),
        lambda plan: NO_PRIVACY.client_level(plan, object(), 3),
        lambda plan: NO_PRIVACY.secure_aggregator(plan, ["a", "b"], None, 1.0),
        lambda plan: NO_PRIVACY.run_record(plan, [], {}),
    ],
)
def test_without_privacy_loaded_a_private_plan_is_refused(call):
    with pytest.raises(RuntimeError, match=r"models/plans/dp.json: the plan sets privacy, but pipeline.privacy is not"):
        call(PRIVATE)


def test_a_checkpoint_with_dp_steps_is_refused_without_privacy():
    with pytest.raises(RuntimeError, match="DP-SGD steps"):
        NO_PRIVACY.restore_dp_steps("ctx", 12)


def test_importing_privacy_registers_each_hook():
    for name in vars(NO_PRIVACY):
        assert getattr(PRIVACY, name) is getattr(seam, name), name
