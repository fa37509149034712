"""The privacy package's door: the calls other modules make (one or two each), so that what a privacy mode
changes stays in pipeline/privacy/ and a run without privacy goes through the same code with ``None`` back."""
from __future__ import annotations

from pipeline.privacy.accounting import client_privacy, sampled_per_round, server_setting
from pipeline.privacy.example_dp import DPSGDSteps
from pipeline.privacy.record import mlflow_metrics, run_record  # noqa: F401  (metrics.json's and MLflow's)


def local_steps(plan, module, examples, seed: int, where: str, micro_batches, normalisation: str,
                max_target_length: int, proximal=None) -> DPSGDSteps | None:
    """The local trainer's step object under privacy.mode example (DP-SGD on ``module``, the local adapter set,
    for this client's ``examples``), or None: the trainer then takes its plain steps."""
    if plan.privacy is None or plan.privacy.mode != "example":
        return None
    cfg = plan.train
    setting = client_privacy(plan.privacy, len(examples), cfg.batch_size * cfg.grad_accum_steps, cfg.rounds,
                             cfg.local_epochs, where=where)
    return DPSGDSteps(module, setting, seed, examples, micro_batches, normalisation, max_target_length, proximal)


def check_run(plan) -> None:
    """Refuse, before anything trains, a delta of 1/n or more (n: a client's training examples after the run's
    cap; mode client: the clients) or an unreachable target epsilon, in one line naming key, plan and client."""
    from pipeline.common.config import ConfigError
    from pipeline.training.client_data import read_partition

    cfg = plan.privacy
    if cfg is None or not cfg.enabled or not plan.spec.federated:
        return
    clients = read_partition(plan.paths["partition"])["clients"]
    where, t = plan.source or plan.experiment, plan.train
    try:
        if cfg.mode == "client":
            server_setting(plan, len(clients))
            return
        for name, splits in clients.items():
            n = len(splits["train"])
            n = n if t.max_train_examples_per_client is None else min(n, t.max_train_examples_per_client)
            client_privacy(cfg, n, t.batch_size * t.grad_accum_steps, t.rounds, t.local_epochs,
                           where=f"{where}: client {name!r}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def client_level(plan, strategy, population: int):
    """(strategy, record): under privacy.mode client, the DP strategy around ``strategy`` twice (it is also the
    server's per-round record); else ``strategy`` and None."""
    if plan.privacy is None or plan.privacy.mode != "client":
        return strategy, None
    from pipeline.privacy.client_dp import ClientLevelDP
    from pipeline.privacy.settings import client_level_problem

    problem = client_level_problem(plan.spec, plan.train.transfer_dtype, plan.privacy)
    if problem:  # the plan stage refuses it; a plan file written by hand is refused here
        raise ValueError(f"{plan.source}: privacy.mode client: {problem}")
    dp = ClientLevelDP(strategy, plan, server_setting(plan, population))
    return dp, dp


def secure_aggregator(plan, clients: list[str], late: str | None, timeout: float,
                      sizes: dict[str, dict[str, int]] | None = None):
    """The plan's SecAgg+ round runner, checked against the method and the clients (``late``: the client that
    joins later; ``sizes``: the train sizes the clients reported at admission, else the partition file's)."""
    if plan.privacy is None or not plan.privacy.secure_aggregation:
        return None
    from pipeline.privacy.secure_aggregation import SecureAggregator
    from pipeline.privacy.settings import secure_aggregation_refusal
    from pipeline.training.client_data import read_partition

    refusal = secure_aggregation_refusal(plan.spec, plan.train.transfer_dtype, plan.privacy)
    if refusal is not None:  # a plan file written by hand: the plan stage refuses it already
        raise ValueError(f"{plan.source or plan.experiment}: privacy.secure_aggregation: {refusal}")
    first = len([c for c in clients if c != late])
    per_round = sampled_per_round(first, plan.train.fraction_train)  # Flower's sample size
    if per_round < 2:
        raise ValueError(f"{plan.experiment}: privacy.secure_aggregation needs at least 2 clients in every round's "
                         f"sum; {first} clients x train.fraction_train {plan.train.fraction_train} samples "
                         f"{per_round}")
    if plan.privacy.mode == "client":  # uniform weights (the mean the noise is calibrated to), clipped bits summed
        return SecureAggregator(plan.privacy.secagg, 1, len(clients), timeout, clipped_bits=True)
    # The largest FedAvg weight a client can report (its train size, or fewer with train.weight_by: trained):
    # it fixes Flower's integer weights (pipeline.privacy.secure_aggregation.weight_scale).
    reported = [sizes.get(c, {}).get("num-train") for c in clients] if sizes else [None]
    if None in reported:
        reported = [len(c["train"]) for c in read_partition(plan.paths["partition"])["clients"].values()]
    return SecureAggregator(plan.privacy.secagg, max(reported), len(clients), timeout)


def register_train(app, train_round):
    """Register the ClientApp's train handler behind SecAgg+'s mod and client-level DP's clipping mod (also on the
    masked-vector stage, Flower's legacy FitIns, before the masking). The client, not the server, decides whether
    its adapter may leave in the clear: under ``privacy.secure_aggregation`` it refuses a plain train message."""
    from pipeline.federation.protocol import load_plan, plan_path_of
    from pipeline.privacy.client_dp import client_dp_mod
    from pipeline.privacy.secure_aggregation import is_legacy_fit, legacy_fit, secure_aggregation_mod

    @app.train(mods=[secure_aggregation_mod, client_dp_mod])
    def client_train(msg, context):
        if is_legacy_fit(msg):
            return legacy_fit(msg, context, lambda m, c: client_dp_mod(m, c, train_round))
        plan = load_plan(plan_path_of(msg, context))
        if plan.privacy is not None and plan.privacy.secure_aggregation:
            raise ValueError(f"{plan.experiment}: the plan sets privacy.secure_aggregation; this client uploads "
                             f"its adapter only through SecAgg+")
        return train_round(msg, context)

    return client_train


STEPS_KEY = "privacy"  # a client's context.state: its DP-SGD steps over all rounds so far (the accountant's history)


class ClientLedger:
    """A client's DP-SGD steps across rounds (mode example), kept in its ``context.state`` and its checkpoints, so
    that a restarted client keeps composing."""

    def __init__(self, context):
        self.state = context.state

    @property
    def steps(self) -> int | None:
        """None when the client has taken no step under DP (its checkpoint then records none)."""
        return int(self.state[STEPS_KEY]["steps"]) if STEPS_KEY in self.state else None

    def restore(self, steps: int | None) -> None:
        from flwr.app import MetricRecord

        if steps is not None:
            self.state[STEPS_KEY] = MetricRecord({"steps": int(steps)})

    def account(self, result) -> dict[str, float | int]:
        """The round's reply metrics of privacy (-1: unbounded): the accountant's (epsilon, delta) over every DP-SGD
        step so far, the setting and the round's clipped per-example gradients; {} without example-level DP."""
        setting = result.privacy
        if setting is None:
            return {}
        total = (self.steps or 0) + int(result.n_steps)
        self.restore(total)
        eps, c = setting.epsilon(total), setting.max_grad_norm
        return {"dp-epsilon": float(eps) if eps != float("inf") else -1.0, "dp-delta": float(setting.delta),
                "dp-noise-multiplier": float(setting.noise_multiplier),
                "dp-max-grad-norm": float(c) if c != float("inf") else -1.0,
                "dp-sample-rate": float(setting.sample_rate), "dp-steps": int(total),
                "dp-examples": int(result.dp_examples), "dp-clipped": int(result.dp_clipped)}
