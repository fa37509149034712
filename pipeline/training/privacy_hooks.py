"""Where privacy plugs into a run, the way strategies and KD gates plug in: registered, not imported by what it
wraps. pipeline.privacy registers its mechanisms into :data:`PRIVACY` when it is imported, and the entry points that
build runs import it (the train stage; pipeline.apps, the apps `flwr run` loads). The defaults below are a run
without privacy: a plan that sets privacy in a process where privacy is not registered is refused, never run in the
clear."""

from __future__ import annotations

from types import SimpleNamespace


def _unprotected(plan) -> None:
    if plan.privacy is not None:
        raise RuntimeError(
            f"{plan.source or plan.experiment}: the plan sets privacy, but pipeline.privacy is not loaded in this "
            f"process (its entry point imports it, which registers its mechanisms)"
        )


def _local_steps(plan, *args, **kwargs) -> None:
    _unprotected(plan)


def _client_level(plan, strategy, population: int):
    _unprotected(plan)
    return strategy, None


def _secure_aggregator(plan, *args, **kwargs) -> None:
    _unprotected(plan)


def _restore_dp_steps(context, steps: int | None) -> None:
    if steps is not None:
        raise RuntimeError("a checkpoint records DP-SGD steps, but pipeline.privacy is not loaded in this process")


def _run_record(plan, history, clients) -> dict:
    _unprotected(plan)
    return {"privacy": None}


# The calls a run makes where privacy changes something (pipeline.privacy.seam documents each), as a run without it.
NO_PRIVACY = SimpleNamespace(
    local_steps=_local_steps,  # a client's DP-SGD steps (else None: the trainer's plain steps)
    client_level=_client_level,  # (the server's strategy, its client-level DP round record)
    secure_aggregator=_secure_aggregator,  # the SecAgg+ round runner, or None
    client_train=lambda msg, context, train_round: train_round(msg, context),  # the ClientApp's train handler
    train_mods=lambda: [],  # Flower mods around it
    dp_steps=lambda context: None,  # a client's DP-SGD steps so far
    restore_dp_steps=_restore_dp_steps,
    account=lambda context, result: {},  # a train reply's privacy metrics
    run_record=_run_record,  # metrics.json's privacy records
    mlflow_metrics=lambda metrics: {},
)
PRIVACY = SimpleNamespace(**vars(NO_PRIVACY))


def register_privacy(**mechanisms) -> None:
    """pipeline.privacy's registration: each call of :data:`PRIVACY` it implements, by name."""
    if unknown := sorted(set(mechanisms) - set(vars(NO_PRIVACY))):
        raise ValueError(f"unknown privacy hook(s) {unknown}; known: {sorted(vars(NO_PRIVACY))}")
    vars(PRIVACY).update(mechanisms)
