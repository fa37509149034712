"""Where privacy plugs into a run, the way strategies and KD gates plug in: registered, not imported by what it
wraps. pipeline.privacy registers its mechanisms into :data:`PRIVACY` when it is imported, and the entry points that
build runs import it (the train stage; pipeline.apps, the apps `flwr run` loads). The defaults below are a run
without privacy: a plan that sets privacy in a process where privacy is not registered is refused, never run in the
clear."""

from __future__ import annotations

from types import SimpleNamespace


def _unprotected(plan, result=None):
    """``result`` for a plan without privacy; a plan that sets privacy is refused."""
    if plan.privacy is not None:
        raise RuntimeError(
            f"{plan.source or plan.experiment}: the plan sets privacy, but pipeline.privacy is not loaded in this "
            f"process (its entry point imports it, which registers its mechanisms)"
        )
    return result


def _restore_dp_steps(context, steps: int | None) -> None:
    if steps is not None:
        raise RuntimeError("a checkpoint records DP-SGD steps, but pipeline.privacy is not loaded in this process")


# The calls a run makes where privacy changes something (pipeline.privacy.seam documents each), as a run without it.
NO_PRIVACY = SimpleNamespace(
    check_run=lambda plan, sizes=None: _unprotected(plan),  # refuse a delta or target a client cannot meet
    local_steps=lambda plan, *args, **kwargs: _unprotected(plan),  # a client's DP-SGD steps (None: the plain ones)
    client_level=lambda plan, strategy, population: _unprotected(plan),  # the server's DP strategy, or None
    secure_aggregator=lambda plan, *args, **kwargs: _unprotected(plan),  # the SecAgg+ round runner, or None
    client_train=lambda msg, context, train_round: train_round(msg, context),  # the ClientApp's train handler
    dp_steps=lambda context: None,  # a client's DP-SGD steps so far
    restore_dp_steps=_restore_dp_steps,
    account=lambda context, result: {},  # a train reply's privacy metrics
    run_record=lambda plan, history, clients: _unprotected(plan, {"privacy": None}),  # metrics.json's records
    mlflow_metrics=lambda metrics: {},
)
PRIVACY = SimpleNamespace(**vars(NO_PRIVACY))


def register_privacy(mechanisms) -> None:
    """pipeline.privacy's registration: ``mechanisms`` (its seam module) implements every call of :data:`PRIVACY`."""
    vars(PRIVACY).update({name: getattr(mechanisms, name) for name in vars(NO_PRIVACY)})
