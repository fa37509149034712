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
