import time
from tests.test_deployment import _local, ws  # noqa
from tests.test_federated import workspace  # noqa
from tests.test_privacy import _write_plan

def test_time(ws):
    from pipeline.federation.local import LocalFederation
    for kind, priv in (("plain", None), ("secure", {"secure_aggregation": True})):
        fed = LocalFederation(_local(_write_plan(f"t-{kind}", "fedavg", priv, rounds=2)))
        with fed:
            fed.start()
            t = time.perf_counter()
            run = fed.stream(fed.submit())
            print(f"DEPLOY {kind}: returncode {run.returncode}, run {time.perf_counter() - t:.1f} s (2 rounds, 3 SuperNodes)")
