"""Example-level DP-SGD inside each organisation (params ``privacy.mode: example``, README "Privacy"): Poisson
micro-batches, per-example clipping and Gaussian noise, hidden behind :class:`DPSGDStep` (the local trainer's one
step path asks it for its batches and its gradient).

The mechanism (Abadi et al. 2016), per optimizer step of a client's local training:

- Sampling: Poisson. Every training example joins the step's logical batch independently with probability
  ``q = batch_size * grad_accum_steps / n`` (opacus' ``UniformWithReplacementSampler``, the sampler of its
  ``DPDataLoader``); an epoch is ``ceil(n / (batch_size * grad_accum_steps))`` such steps, as without privacy.
  The logical batch (random size, possibly empty) is cut into micro-batches of ``train.batch_size`` for memory.
- Per-example loss: a function of the example alone, so that clipping bounds its whole contribution. The
  project's token mean over the effective batch divides by the batch's token count, which depends on the other
  examples (removing one rescales everyone's share), so it cannot be clipped per example. Instead, with
  ``train.loss_normalisation: tokens``, ``l_i = sum_t L_t / max_target_length`` (every token weighs the same, as
  in the token mean, over a public denominator); with ``sequences``, ``l_i = mean_t L_t``.
- Per-example gradients ``g_i`` of ``l_i`` (opacus' ``GradSampleHooks`` on the local adapter set), clipped as
  opacus' DPOptimizer clips: ``g_i * min(1, C / (||g_i|| + 1e-6))``, summed over the micro-batches of the step.
- Noise ``N(0, sigma^2 C^2)`` on every coordinate of the sum, then division by the expected batch size ``q n``
  (public). A data-independent term (the FedProx proximal gradient) is added after the noise; AdamW's moments and
  weight decay are post-processing.

The accountant (opacus RDP or PRV) composes ``(sigma, q, steps)`` over every step the client takes in every round
it trains; each client reports ``(epsilon, delta)`` with ``delta = 1 / n`` unless set. ``target_epsilon`` gives
the noise multiplier from the planned steps: every round, ``rounds * local_epochs * steps_per_epoch`` (a client
sampled in fewer rounds ends below the target). The noise comes from torch's seeded generator (reproducible
runs); it is not a cryptographic source (opacus' secure_mode needs torchcsprng, which is not installed).

Secure aggregation (``secure_aggregation: true``, the ``secagg`` settings; pipeline.privacy.secure_aggregation):
the server receives the weighted sum of the uploads through Flower's SecAgg+ protocol instead of each client's
upload. Only methods whose server merely averages can use it, and with mode client only client-side clipping
(:func:`secure_aggregation_refusal`).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from pipeline.privacy.accounting import ClientPrivacy
from pipeline.training.seeds import derived_seed

# The first adapter's input is the frozen prefix (no gradient): torch warns on every backward that opacus' full
# backward hook then sees only output gradients, which is all it needs.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs since no inputs require gradients")


def poisson_steps(n_examples: int, q: float, n_steps: int, seed: int) -> list[list[int]]:
    """The example indices of each step: opacus' Poisson sampler with a seeded generator."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    generator = torch.Generator().manual_seed(seed)
    return [list(idx) for idx in UniformWithReplacementSampler(num_samples=n_examples, sample_rate=q,
                                                               generator=generator, steps=n_steps)]


# ----------------------------------------------------------------------------------------------- the step
class DPSGDStep:
    """Per-example clipping, summing across micro-batches and Gaussian noise for one adapter set.

    Usage per step: for each micro-batch, ``backward`` the sum of its per-example losses, then
    :meth:`accumulate`; after the last one, :meth:`finish` writes ``(sum clipped + noise) / logical_batch`` into
    ``p.grad``. Call :meth:`close` when done (removes opacus' hooks from the shared model)."""

    def __init__(self, module: torch.nn.Module, setting: ClientPrivacy, seed: int):
        from opacus.grad_sample import GradSampleHooks

        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.setting = setting
        # sum reduction: grad_sample[i] is the gradient of example i's own loss l_i (no batch-size rescaling)
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction="sum")
        self._generator = torch.Generator(device=self.params[0].device).manual_seed(seed)
        self._summed: list[torch.Tensor] | None = None
        self.clipped = 0  # per-example gradients whose norm exceeded C (over every step)
        self.examples = 0  # per-example gradients clipped or not

    def per_example_norms(self) -> torch.Tensor:
        grads = [p.grad_sample for p in self.params]
        return torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in grads], dim=1).norm(2, dim=1)

    def accumulate(self) -> torch.Tensor:
        """Clip this micro-batch's per-example gradients, add them to the step's sum; returns their norms."""
        norms = self.per_example_norms()
        c = self.setting.max_grad_norm
        factor = (c / (norms + 1e-6)).clamp(max=1.0)  # opacus' DPOptimizer formula (C = inf -> 1)
        clipped = [torch.einsum("i,i...->...", factor.to(p.grad_sample.dtype), p.grad_sample) for p in self.params]
        self._summed = clipped if self._summed is None else [s + g for s, g in zip(self._summed, clipped)]
        self.clipped += int((norms > c).sum())
        self.examples += len(norms)
        for p in self.params:
            p.grad_sample = None  # consumed: opacus would otherwise stack the next micro-batch onto it
            p.grad = None  # the unclipped sum autograd also accumulated is never used
        return norms

    def finish(self) -> None:
        """p.grad = (sum of clipped per-example gradients + N(0, sigma^2 C^2)) / expected batch size."""
        s = self.setting
        std = s.noise_multiplier * s.max_grad_norm if s.noise_multiplier > 0 else 0.0  # 0 * inf stays 0
        summed = self._summed or [torch.zeros_like(p) for p in self.params]  # an empty Poisson batch: noise only
        for p, total in zip(self.params, summed):
            noise = torch.normal(0.0, std, size=p.shape, generator=self._generator, device=p.device) if std else 0.0
            p.grad = ((total + noise) / s.logical_batch).to(p.dtype)
        self._summed = None

    def close(self) -> None:
        self._hooks.cleanup()
        for p in self.params:
            for attr in ("grad_sample", "_current_grad_sample"):
                if hasattr(p, attr):
                    delattr(p, attr)


def per_example_loss_scale(batch, normalisation: str, max_target_length: int) -> float:
    """The factor turning ``distillation_loss``'s batch mean into the sum of per-example losses of DP-SGD:
    ``tokens``: sum_t L_t / max_target_length per example (the batch mean x N_tokens / T_max); ``sequences``:
    the mean of each example's L_t (the batch mean x the number of sequences)."""
    from pipeline.modeling.batching import IGNORE_INDEX

    valid = batch.labels != IGNORE_INDEX
    if normalisation == "tokens":
        return int(valid.sum()) / max_target_length
    return float(int((valid.sum(dim=1) > 0).sum()))


def poisson_epoch(examples, micro_batches, setting: ClientPrivacy, normalisation: str, max_target_length: int,
                  seed: int) -> list[list[tuple[Any, float]]]:
    """One epoch of DP-SGD: Poisson-sampled logical batches (:func:`poisson_steps`; a step may be empty), each cut
    by ``micro_batches`` (a frame of examples -> its batches of ``train.batch_size``, in order) with the scale of
    :func:`per_example_loss_scale`."""
    steps = []
    for idx in poisson_steps(len(examples), setting.sample_rate, setting.steps_per_epoch, seed):
        batches = micro_batches(examples.iloc[idx]) if idx else []
        steps.append([(b, per_example_loss_scale(b, normalisation, max_target_length)) for b in batches])
    return steps


class DPSGDSteps:
    """The local trainer's step object under mode example (the same interface as its non-private one,
    pipeline.training.client_training.PlainSteps): :meth:`epoch` gives an epoch's steps of (micro-batch, weight)
    from Poisson samples, :meth:`backward` backpropagates a micro-batch's per-example loss sum and clips it,
    :meth:`finish` adds the noise and then the proximal gradient (data-independent: outside the clipping)."""

    def __init__(self, module: torch.nn.Module, setting: ClientPrivacy, seed: int, examples, micro_batches,
                 normalisation: str, max_target_length: int, proximal=None):
        self.seed, self.examples_frame, self.micro_batches = seed, examples, micro_batches
        self.normalisation, self.max_target_length = normalisation, max_target_length
        self.proximal = proximal
        self.step = DPSGDStep(module, setting, derived_seed(seed, "dp-noise"))
        self.setting = setting

    def epoch(self, epoch: int) -> list[list[tuple[Any, float]]]:
        return poisson_epoch(self.examples_frame, self.micro_batches, self.setting, self.normalisation,
                             self.max_target_length, derived_seed(self.seed, epoch, "poisson"))

    def backward(self, loss: torch.Tensor, weight: float) -> None:
        (loss * weight).backward()  # weight turns the batch mean into the sum of per-example losses
        self.step.accumulate()

    def finish(self) -> None:
        self.step.finish()
        if self.proximal is not None:
            self.proximal.add_gradient()

    def close(self) -> None:
        self.step.close()

    @property
    def examples(self) -> int:
        return self.step.examples

    @property
    def clipped(self) -> int:
        return self.step.clipped
