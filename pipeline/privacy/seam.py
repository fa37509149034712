"""The privacy package's door: the calls other modules make (one or two each), so that what a privacy mode
changes stays in pipeline/privacy/ and a run without privacy goes through the same code with ``None`` back."""
from __future__ import annotations

from pipeline.privacy.accounting import client_privacy
from pipeline.privacy.example_dp import DPSGDSteps


def local_steps(plan, module, examples, seed: int, where: str, micro_batches, normalisation: str,
                max_target_length: int, proximal=None) -> DPSGDSteps | None:
    """The local trainer's step object under privacy.mode example (DP-SGD on ``module``, the local adapter set,
    for this client's ``examples``), or None: the trainer then takes its plain steps (mode client's mechanism is
    the server's wrapper and the client's clipping mod, not the local step)."""
    if plan.privacy is None or plan.privacy.mode != "example":
        return None
    cfg = plan.train
    setting = client_privacy(plan.privacy, len(examples), cfg.batch_size * cfg.grad_accum_steps, cfg.rounds,
                             cfg.local_epochs, where=where)
    return DPSGDSteps(module, setting, seed, examples, micro_batches, normalisation, max_target_length, proximal)


def check_run(plan) -> None:
    """Refuse, before anything trains, a privacy setting that cannot hold for one of the plan's clients: a delta
    of 1/n or more (n: the examples a client trains on, after the run's cap; mode client: the clients), or a
    target epsilon the accountant cannot reach. One line naming the params key, the plan and the client."""
    from pipeline.common.config import ConfigError
    from pipeline.privacy.client_dp import server_setting
    from pipeline.training.client_data import read_partition

    cfg = plan.privacy
    if cfg is None or not cfg.enabled or not plan.spec.federated:
        return
    clients = read_partition(plan.paths["partition"])["clients"]
    where = plan.source or plan.experiment
    try:
        if cfg.mode == "client":
            server_setting(plan, len(clients))
            return
        t = plan.train
        for name, splits in clients.items():
            n = len(splits["train"])
            n = n if t.max_train_examples_per_client is None else min(n, t.max_train_examples_per_client)
            client_privacy(cfg, n, t.batch_size * t.grad_accum_steps, t.rounds, t.local_epochs,
                           where=f"{where}: client {name!r}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run_record(plan, history, clients):
    """metrics.json's privacy parts of a finished run (pipeline.privacy.record.run_record)."""
    from pipeline.privacy.record import run_record as record

    return record(plan, history, clients)


def mlflow_metrics(metrics):
    """The run's closing MLflow metrics of privacy (pipeline.privacy.record.mlflow_metrics)."""
    from pipeline.privacy.record import mlflow_metrics as of

    return of(metrics)


def client_level(plan, strategy, population: int):
    """(strategy, record): under privacy.mode client, Flower's DP wrapper around ``strategy`` and the server's
    per-round record (pipeline.privacy.client_dp.RoundPrivacy); else ``strategy`` itself and None."""
    if plan.privacy is None or plan.privacy.mode != "client":
        return strategy, None
    from pipeline.privacy.client_dp import RoundPrivacy, wrap_strategy

    record = RoundPrivacy(plan, population)
    return wrap_strategy(strategy, plan, record.setting), record


def secure_aggregator(plan, clients: list[str], late: str | None, timeout: float,
                      sizes: dict[str, dict[str, int]] | None = None):
    """The plan's SecAgg+ round runner (privacy.secure_aggregation), checked against the method and the clients
    (``late``: the client that joins later, not there in the first rounds; ``sizes``: the train sizes the clients
    reported at admission, else the partition file's)."""
    if plan.privacy is None or not plan.privacy.secure_aggregation:
        return None
    from pipeline.privacy.secure_aggregation import SecureAggregator
    from pipeline.privacy.settings import secure_aggregation_refusal
    from pipeline.training.client_data import read_partition

    refusal = secure_aggregation_refusal(plan.spec, plan.train.transfer_dtype, plan.privacy)
    if refusal is not None:  # a plan file written by hand: the plan stage refuses it already
        raise ValueError(f"{plan.source or plan.experiment}: privacy.secure_aggregation: {refusal}")
    first = len([c for c in clients if c != late])
    per_round = max(int(first * plan.train.fraction_train), 1)  # Flower's sample size
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


def train_mods() -> list:
    """The ClientApp train handler's mods: SecAgg+'s (its protocol messages), then client-level DP's clipping."""
    from pipeline.privacy.client_dp import client_dp_mod
    from pipeline.privacy.secure_aggregation import secure_aggregation_mod

    return [secure_aggregation_mod, client_dp_mod]


def masked_round(msg, context, train_masked):
    """A SecAgg+ round's masked-vector stage (Flower's legacy FitIns): the same round's training, ``train_masked``,
    clipped by client_dp_mod before secaggplus_mod masks the upload; None for any other train message."""
    from pipeline.privacy.client_dp import client_dp_mod
    from pipeline.privacy.secure_aggregation import is_legacy_fit, legacy_fit

    if not is_legacy_fit(msg):
        return None
    return legacy_fit(msg, context, lambda m, c: client_dp_mod(m, c, train_masked))
