"""FedProx (Li et al. 2020): FedAvg's server; each client adds mu/2 ||W - W_global||^2 to its local loss. Flower's
``FedProx`` only ships ``proximal-mu`` in the train config (pipeline.federation.client_app reads it)."""

from __future__ import annotations

from pipeline.common.config import config
from pipeline.federation.strategies.registry import register_strategy


@config
class FedProxSettings:
    # params train.proximal_mu (a flat key, older than the registry; FedNLP tunes mu in {0.001, 0.01, 0.1, 1}).
    proximal_mu: float = 0.01


@register_strategy("fedprox", FedProxSettings, group=None, averaging=True, proximal=True)
def build(settings: FedProxSettings, common, client_lr):
    from flwr.serverapp.strategy import FedProx

    return FedProx(**common, proximal_mu=settings.proximal_mu)
