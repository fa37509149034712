"""FedNova (Wang et al., NeurIPS 2020): normalised averaging by the number of local steps. Flower has none: a
subclass of Flower's ``FedAvg`` whose ``aggregate_train`` normalises each update by its client's steps."""

from __future__ import annotations

import numpy as np

from pipeline.federation.strategies.registry import NUM_STEPS_KEY, register_strategy


def _fednova_class():
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    class FedNova(FedAvg):
        """With client updates ``Delta_i = W - W_i`` after ``tau_i`` local steps and weights ``p_i = |D_i| / |D|``:
        ``d = sum_i p_i Delta_i / tau_i`` (each update normalised per step), ``tau_eff = sum_i p_i tau_i``,
        ``W_new = W - tau_eff * d``. Equal step counts give FedAvg exactly. Clients report ``num-steps``.
        """

        def configure_train(self, server_round, arrays, config, grid):
            # The update is taken relative to what was sent this round.
            self.current_arrays = {k: a.numpy() for k, a in arrays.items()}
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            valid, _ = self._check_and_log_replies(replies, is_train=True)
            if not valid:
                return None, None
            contents = [m.content for m in valid]
            replied = [next(iter(c.metric_records.values())) for c in contents]
            for metrics in replied:
                if NUM_STEPS_KEY not in metrics or metrics[NUM_STEPS_KEY] <= 0:
                    raise ValueError(f"FedNova: reply without a positive '{NUM_STEPS_KEY}' metric: {dict(metrics)}")
            weights = np.array([float(m[self.weighted_by_key]) for m in replied])
            p = weights / weights.sum()
            steps = np.array([float(m[NUM_STEPS_KEY]) for m in replied])
            tau_eff = float((p * steps).sum())
            new = {}
            for key, w_global in self.current_arrays.items():
                d = np.zeros_like(w_global, dtype=np.float64)
                for content, p_i, tau_i in zip(contents, p, steps):
                    w_i = next(iter(content.array_records.values()))[key].numpy()
                    d += p_i * (w_global.astype(np.float64) - w_i) / tau_i
                new[key] = Array(np.asarray(w_global - tau_eff * d, dtype=w_global.dtype))
            return ArrayRecord(new), self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    return FedNova


@register_strategy("fednova")
def build(settings, common, client_lr):
    return _fednova_class()(**common)
