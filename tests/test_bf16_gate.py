"""bf16 autocast (the batched local trainer's on CUDA, pipeline/training/local_batch.py) does not move the KD gate:
on a real batch (SAMSum test dialogues and the MiniLM BERT2BERT of the offline recipe), the selective-KD gate of
every run of a stacked group, decided with the student under bf16 autocast, agrees with float32's on >= 99.9 % of
target tokens (the teacher runs in float32, the loss reads every logit in float32). Autocast runs here on the CPU,
with the trainer's own forward (``stacked_logits``), as it does on a GPU."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]

# The SAMSum test dialogues with the longest summaries: 1,433 target tokens in 24 rows of 63 positions, where the
# first 64 dialogues give 1,637 in 64 rows, most of them padding (the test: 55 s alone on 2 cores, against 79 s)
EXAMPLES = 24


def _real_batch(model, shared_data):
    from pipeline.experiments.model import ModelConfig
    from pipeline.modeling.batching import make_batches

    records = pd.read_json(shared_data / "samsum" / "test.json", lines=True)
    records = records.loc[records["summary"].str.len().nlargest(EXAMPLES).index]
    frame = pd.DataFrame(
        {"example_id": records["id"].astype(str), "source": records["dialogue"], "target": records["summary"]}
    )
    cfg = ModelConfig(max_source_length=128, max_target_length=64)
    return make_batches(frame, model, cfg, EXAMPLES, False, 0)[0]


@pytest.mark.timeout(400)  # ~55 s alone: the real MiniLM in bf16 on a CPU; slower beside the full lane's workers
def test_bf16_autocast_keeps_the_gate_decisions_of_float32(shared_data):
    from pipeline.modeling.adapter_stack import AdapterStack
    from pipeline.modeling.adapters import AdapterConfig
    from pipeline.modeling.losses import KDConfig, distillation_loss, teacher_entropy
    from pipeline.modeling.model import AdapterSummarizer
    from pipeline.modeling.warmup import build_bert2bert, init_cross_attention_from_self, minilm_dir
    from pipeline.training.local_batch import stacked_logits

    torch.manual_seed(0)
    backbone, tokenizer = build_bert2bert(minilm_dir())
    init_cross_attention_from_self(backbone)
    model = AdapterSummarizer(backbone, tokenizer, AdapterConfig(top_k=2, bottleneck=64, seed=0), "cpu")
    generator = torch.Generator().manual_seed(1)
    start = model.adapter_state("local")
    # two runs, each with its own teacher (W_up away from zero: not the bare backbone)
    teachers = [{k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in start.items()} for _ in range(2)]
    template = model.adapter_sets["local"]
    local, teacher = AdapterStack([start, start], template, "cpu"), AdapterStack(teachers, template, "cpu")
    batch = _real_batch(model, shared_data)
    prefix, labels = model.compute_prefix(batch).repeat(2), batch.labels.repeat(2, 1)  # the runs' two blocks
    logits = {
        bf16: stacked_logits(model, prefix, labels, batch.attention_mask.repeat(2, 1), local, teacher, 2, bf16)
        for bf16 in (False, True)
    }
    assert logits[True][0].dtype == torch.bfloat16 and logits[False][0].dtype == torch.float32
    n = int((batch.labels != -100).sum())
    assert n >= 1000  # 0.1 % of the tokens is at least one token
    for r in range(2):
        rows = slice(r * n, (r + 1) * n)
        # tau at the teacher's median entropy: the most tokens near the threshold, the hardest place for the gate
        tau = float(teacher_entropy(logits[False][1][rows], "e").median())
        cfg = KDConfig(mode="selective", tau=tau)
        gates = [
            distillation_loss(student[rows], z_g[rows], batch.labels, cfg).gate_rows for student, z_g in logits.values()
        ]
        assert 0.3 < float(gates[0].float().mean()) < 0.7
        agreement = float((gates[0] == gates[1]).float().mean())
        assert agreement >= 0.999, (r, agreement, n)
