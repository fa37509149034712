"""FedAvg (McMahan et al. 2017; METHOD.md section 5): the new global is the mean of the replies weighted by
``num-examples``. Flower's ``FedAvg``."""

from __future__ import annotations

from pipeline.federation.strategies.registry import register_strategy


@register_strategy("fedavg")
def build(settings, common, client_lr):
    from flwr.serverapp.strategy import FedAvg

    return FedAvg(**common)
