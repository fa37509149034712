"""Example-level DP-SGD inside each organisation (``privacy.mode: example``, Abadi et al. 2016; docs/privacy.md),
the local trainer's step object :class:`DPSGDSteps`. The noise comes from torch's seeded generator (reproducible
runs), not a cryptographic source (opacus' secure_mode needs torchcsprng, which is not installed)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pipeline.privacy.accounting import ClientPrivacy
from pipeline.training.seeds import derived_seed

# The first adapter's input is the frozen prefix (no gradient): torch warns on every backward that opacus' full
# backward hook then sees only output gradients, which is all it needs.
warnings.filterwarnings(
    "ignore",
    message="Full backward hook is firing when gradients are computed with respect "
    "to module outputs since no inputs require gradients",
)


def poisson_steps(n_examples: int, q: float, n_steps: int, seed: int) -> list[list[int]]:
    """The example indices of each step: opacus' Poisson sampler with a seeded generator."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler  # lazy: importing opacus takes ~6 s

    generator = torch.Generator().manual_seed(seed)
    sampler = UniformWithReplacementSampler(num_samples=n_examples, sample_rate=q, generator=generator, steps=n_steps)
    return [list(idx) for idx in sampler]


class DPSGDSteps:
    """The DP-SGD round's step object under mode example (client_training._private_round drives it):
    per-example clipping, summing across micro-batches and Gaussian noise for one adapter set. Per micro-batch,
    :meth:`backward` its per-example loss sum (:meth:`accumulate`); then :meth:`finish`, which adds the proximal
    gradient after the noise (it is data-independent: outside the clipping); :meth:`close` removes the hooks."""

    def __init__(
        self, module: torch.nn.Module, setting: ClientPrivacy, seed: int, examples, micro_batches, proximal=None
    ):
        from opacus.grad_sample import GradSampleHooks  # lazy for start-up time: importing opacus takes ~6 s

        self.seed, self.frame, self.micro_batches, self.proximal = seed, examples, micro_batches, proximal
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.setting = setting
        # sum reduction: grad_sample[i] is the gradient of example i's own loss l_i (no batch-size rescaling)
        self._hooks = GradSampleHooks(module, batch_first=True, loss_reduction="sum")
        self._generator = torch.Generator(device=self.params[0].device).manual_seed(derived_seed(seed, "dp-noise"))
        self._summed: list[torch.Tensor] | None = None
        self.clipped = 0  # per-example gradients whose norm exceeded C (over every step)
        self.examples = 0  # per-example gradients clipped or not

    def epoch(self, epoch: int) -> list[list[tuple[Any, float]]]:
        """One epoch of DP-SGD: Poisson-sampled logical batches (a step may be empty), each cut by ``micro_batches``
        into (micro-batch, per-example loss scale) pairs (pipeline.training.client_training.per_example_loss_scale)."""
        seed = derived_seed(self.seed, epoch, "poisson")
        sampled = poisson_steps(len(self.frame), self.setting.sample_rate, self.setting.steps_per_epoch, seed)
        return [self.micro_batches(self.frame.iloc[idx]) if idx else [] for idx in sampled]

    def backward(self, loss: torch.Tensor, weight: float) -> None:
        (loss * weight).backward()  # weight turns the batch mean into the sum of per-example losses
        self.accumulate()

    def accumulate(self) -> torch.Tensor:
        """Clip this micro-batch's per-example gradients, add them to the step's sum; returns their norms."""
        grads = [p.grad_sample for p in self.params]
        norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in grads], dim=1).norm(2, dim=1)
        c = self.setting.max_grad_norm
        factor = (c / (norms + 1e-6)).clamp(max=1.0)  # opacus' DPOptimizer formula (C = inf -> 1)
        clipped = [torch.einsum("i,i...->...", factor.to(g.dtype), g) for g in grads]
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
        if self.proximal is not None:
            self.proximal.add_gradient()

    def close(self) -> None:
        self._hooks.cleanup()  # opacus removes its hooks and the grad_sample attributes of the parameters
