"""FedTrimmedAvg (Yin et al., ICML 2018): per coordinate, the mean of the replies left after dropping the
``int(beta * n)`` largest and smallest values - robust to a client whose update is far off. Flower's
``FedTrimmedAvg``; unweighted (``num-examples`` is ignored), so neither SecAgg+ nor client-level DP applies.
Settings: params ``train.fedtrimmedavg``; method ``fedtrimmedavg`` (CE, one adapter set, as Table V's rows)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.common.config import config
from pipeline.federation.strategies.registry import register_strategy


@config
class FedTrimmedAvgSettings:
    # Fraction cut from each end per coordinate (the params file's value; Flower's default 0.2 cuts nothing from 3
    # clients, 0.34 cuts one from each end, i.e. the coordinate-wise median of 3).
    beta: Annotated[float, Field(ge=0.0, lt=0.5)] = 0.34


@register_strategy("fedtrimmedavg", FedTrimmedAvgSettings)
def build(settings: FedTrimmedAvgSettings, common, client_lr):
    from flwr.serverapp.strategy import FedTrimmedAvg

    return FedTrimmedAvg(**common, beta=settings.beta)
