"""The stacked trainer's loss of a micro-batch: one call a run (the trainer before 224d089) against one call for the
group (``losses.distillation_losses``), side by side, at the GPU study's vocabulary (MiniLM's 30,522).

    python -m benchmarks.group_loss            # -> reports/bench/group_loss.json, the ratios printed

A group of ``--runs`` runs as the GPU study's set makes them (per seed: AdaSingle and FedAvg plain CE, FedKD on every
token, SelectKD's entropy gate at 5 nats and its quantile gate; the runs with a teacher first), ``--rows`` target
tokens a run, packed student and teacher logits; each way computes every run's loss, weights them as a step does and
runs the backward to the logits. Measured: the least wall seconds of ``--repeats``, the operations dispatched (each
a kernel launch or more on a GPU, where the host issues them) and the bytes the backward allocates (a run's slice of
the logits got a gradient buffer of the whole group's size). Both ways give each run the same loss and gradient to
the bit (tests/test_losses.py); this says what the one call saves, not whether it is right.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import write_json
from pipeline.modeling.losses import KDConfig, distillation_loss, distillation_losses

ARMS = [
    KDConfig(mode="kd", kd_lambda=0.2),
    KDConfig(kd_lambda=0.2, tau=5.0),
    KDConfig(kd_lambda=0.2, tau=0.87, tau_scale="batch_quantile"),
    KDConfig(mode="ce"),
    KDConfig(mode="ce"),
]


class _Count(TorchDispatchMode):
    """Operations dispatched, and the bytes of the tensors the backward creates."""

    def __init__(self):
        super().__init__()
        self.ops, self.backward_bytes, self.in_backward = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if self.in_backward and isinstance(out, torch.Tensor) and out._base is None:  # a new buffer, not a view
            self.backward_bytes += out.numel() * out.element_size()
        return out


def _group(runs: int, rows: int, vocab: int, generator: torch.Generator):
    cfgs = sorted((ARMS[r % len(ARMS)] for r in range(runs)), key=lambda c: c.mode == "ce")  # taught first
    labels = [torch.randint(0, vocab, (8, rows // 8), generator=generator) for _ in cfgs]
    student = torch.randn(runs * rows, vocab, generator=generator) * 2
    taught = rows * sum(c.mode != "ce" for c in cfgs)
    teacher = torch.randn(taught, vocab, generator=generator) * 2
    weights = [0.5] * runs  # grad_accum_steps 2
    return cfgs, labels, student, teacher, weights


def per_run(cfgs, labels, student, teacher, weights):
    z_l, total, start = student.clone().requires_grad_(True), 0, 0
    for cfg, y, w in zip(cfgs, labels, weights):
        end = start + y.numel()
        z_g = teacher[start:end] if end <= teacher.shape[0] else None
        total = total + distillation_loss(z_l[start:end], z_g, y, cfg).loss * w
        start = end
    return z_l, total


def one_call(cfgs, labels, student, teacher, weights):
    z_l = student.clone().requires_grad_(True)
    loss, _ = distillation_losses(z_l, teacher, labels, cfgs, [None] * len(cfgs))
    return z_l, (loss * torch.tensor(weights)).sum()


def measure(way, group, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        way(*group)[1].backward()
        seconds.append(time.perf_counter() - start)
    count = _Count()
    with count:
        _, total = way(*group)
        count.in_backward = True
        total.backward()
    return {"seconds": round(min(seconds), 4), "operations": count.ops, "backward_bytes": count.backward_bytes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=25, help="runs in the group (the GPU study's: 25 a client)")
    parser.add_argument("--rows", type=int, default=640, help="target tokens a run (the study: 8 examples x ~80)")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="reports/bench/group_loss.json")
    args = parser.parse_args(argv)
    group = _group(args.runs, args.rows, args.vocab, torch.Generator().manual_seed(0))
    result = {"device": f"cpu, {torch.get_num_threads()} torch threads"} | {
        k: v for k, v in vars(args).items() if k != "out"
    }
    for name, way in (("per_run", per_run), ("one_call", one_call)):
        result[name] = measure(way, group, args.repeats)
    result["ratio"] = {k: round(result["one_call"][k] / result["per_run"][k], 3) for k in result["per_run"]}
    write_json(Path(args.out), result)
    print(result)


if __name__ == "__main__":
    main()
