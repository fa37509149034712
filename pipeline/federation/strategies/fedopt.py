"""FedOPT (Reddi et al. 2021): a server optimiser on the pseudo-gradient. Flower's ``FedAvgM`` (FedNLP's default:
server SGD with momentum) or ``FedAdam`` / ``FedYogi`` / ``FedAdagrad``; settings params ``train.fedopt``."""

from __future__ import annotations

from typing import Literal

from pipeline.common.config import config
from pipeline.federation.strategies.registry import register_strategy


@config
class FedOptConfig:
    # Server optimiser for `fedopt`: "sgdm" = FedAvgM (FedNLP's default: server SGD, lr 1.0, momentum 0.9),
    # or "adam" | "yogi" | "adagrad" (Reddi et al. 2021, Flower's FedAdam/FedYogi/FedAdagrad).
    server_optimizer: Literal["sgdm", "adam", "yogi", "adagrad"] = "sgdm"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    beta_1: float = 0.9
    beta_2: float = 0.99
    # Adaptivity constant tau of Reddi et al. (named eps here: `tau` is the entropy threshold in this project).
    eps: float = 1.0e-3


@register_strategy("fedopt", FedOptConfig)
def build(fedopt: FedOptConfig, common, client_lr):
    from flwr.serverapp import strategy as fs

    opt = fedopt.server_optimizer
    if opt == "sgdm":
        return fs.FedAvgM(**common, server_learning_rate=fedopt.server_lr, server_momentum=fedopt.server_momentum)
    adaptive = {"adam": fs.FedAdam, "yogi": fs.FedYogi, "adagrad": fs.FedAdagrad}
    kwargs = dict(eta=fedopt.server_lr, eta_l=client_lr, tau=fedopt.eps)
    if opt != "adagrad":
        kwargs.update(beta_1=fedopt.beta_1, beta_2=fedopt.beta_2)
    return adaptive[opt](**common, **kwargs)
