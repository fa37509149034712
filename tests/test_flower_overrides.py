"""Where fedmeet differs from a Flower class it subclasses (the client-level DP wrappers), the upstream code it was
written against is recorded; these tests fail when it changes, so that a maintainer re-checks the override before
trusting it on a new Flower."""
from __future__ import annotations

import hashlib
import inspect

import pytest
from flwr.serverapp import strategy as flower_strategies

from pipeline.privacy import client_dp

RECHECK = ("{name} changed upstream (flwr {version}): re-check {where} against the new code, then record the new "
           "digest {digest}")


def _version() -> str:
    from importlib.metadata import version

    return version("flwr")


def _digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(client_dp.FLOWER_METHODS))
def test_the_flower_methods_the_dp_wrappers_override_are_the_ones_recorded(name):
    cls, method = name.split(".")
    digest = _digest(getattr(getattr(flower_strategies, cls), method))
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
