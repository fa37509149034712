"""FedProx (Li et al. 2020): FedAvg's server; each client adds mu/2 ||W - W_global||^2 to its local loss. Flower's
``FedProx`` only ships ``proximal-mu`` in the train config (pipeline.federation.client_app reads it)."""

from __future__ import annotations

from pipeline.experiments.methods import FedProxSettings
from pipeline.federation.strategies.registry import register_strategy


@register_strategy("fedprox")
def build(settings: FedProxSettings, common, client_lr):
    from flwr.serverapp.strategy import FedProx

    return FedProx(**common, proximal_mu=settings.proximal_mu)
