"""FedTrimmedAvg (Yin et al., ICML 2018): per coordinate, the mean of the replies left after dropping the
``int(beta * n)`` largest and smallest values - robust to a client whose update is far off. Flower's
``FedTrimmedAvg``; unweighted (``num-examples`` is ignored), so neither SecAgg+ nor client-level DP applies.
Settings: params ``train.fedtrimmedavg``; method ``fedtrimmedavg`` (CE, one adapter set, as Table V's rows)."""

from __future__ import annotations

from pipeline.experiments.methods import FedTrimmedAvgSettings
from pipeline.federation.strategies.registry import register_strategy


@register_strategy("fedtrimmedavg")
def build(settings: FedTrimmedAvgSettings, common, client_lr):
    from flwr.serverapp.strategy import FedTrimmedAvg

    return FedTrimmedAvg(**common, beta=settings.beta)
