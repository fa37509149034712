"""Where fedmeet differs from a Flower class it subclasses (the client-level DP wrappers) or stands in for a Flower
function (the Ray engine's message poller), the upstream code it was written against is recorded; these tests
fail when it changes, so that a maintainer re-checks the override before trusting it on a new Flower."""
from __future__ import annotations

import inspect

import pytest
from flwr.serverapp import strategy as flower_strategies

from pipeline.federation import simulation_poller
from pipeline.privacy import client_dp

RECHECK = ("{name} changed upstream (flwr {version}): re-check {where} against the new code, then record the new "
           "digest {digest}")


def _version() -> str:
    from importlib.metadata import version

    return version("flwr")


@pytest.mark.parametrize("name", sorted(client_dp.FLOWER_METHODS))
def test_the_flower_methods_the_dp_wrappers_override_are_the_ones_recorded(name):
    cls, method = name.split(".")
    digest = simulation_poller.source_digest(getattr(getattr(flower_strategies, cls), method))
    assert digest == client_dp.FLOWER_METHODS[name], RECHECK.format(
        name=name, version=_version(), where="pipeline/privacy/client_dp.py (_FedmeetDP, FLOWER_METHODS)",
        digest=digest)


def test_every_method_the_dp_mixin_defines_over_flower_is_recorded():
    """A new override of a Flower method in _FedmeetDP must be recorded too."""
    overridden = {m for m in vars(client_dp._FedmeetDP) if not m.startswith("__")}
    for wrapper in client_dp.WRAPPERS.values():
        flower = wrapper.__mro__[2]  # (wrapper, _FedmeetDP, Flower's class, ...)
        upstream = {m for m in overridden if hasattr(flower, m)}
        recorded = {n.split(".")[1] for n in client_dp.FLOWER_METHODS if n.startswith(flower.__name__ + ".")}
        assert upstream <= recorded, (flower.__name__, sorted(upstream - recorded))


@pytest.mark.parametrize("name", sorted(simulation_poller.UPSTREAM))
def test_the_flower_poller_the_ray_engine_replaces_is_the_one_recorded(name):
    from flwr.server.superlink.fleet.vce import vce_api

    digest = simulation_poller.source_digest(getattr(vce_api, name))
    assert digest == simulation_poller.UPSTREAM[name], RECHECK.format(
        name=f"vce_api.{name}", version=_version(), where="pipeline/federation/simulation_poller.py (UPSTREAM)",
        digest=digest)
    assert simulation_poller.upstream_matches()


def test_a_changed_upstream_poller_is_left_in_place(monkeypatch):
    """Flower's own poller runs when its code is not the recorded one: nothing is patched."""
    from flwr.server.superlink.fleet.vce import vce_api

    monkeypatch.setitem(simulation_poller.UPSTREAM, "add_messages_to_queue", "0" * 16)
    before = vce_api.add_messages_to_queue
    with simulation_poller.linear_polling():
        assert vce_api.add_messages_to_queue is before
    monkeypatch.undo()
    with simulation_poller.linear_polling():
        assert vce_api.add_messages_to_queue is simulation_poller.add_messages_to_queue
    assert vce_api.add_messages_to_queue is before
    assert inspect.getsource(before) == inspect.getsource(simulation_poller._flower_poller)
