"""Stage backbone: local directories, hub ids offline, the offline MiniLM recipe; and pipeline.common.timing."""

from __future__ import annotations

import json
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tiny_models
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, EncoderDecoderModel

from pipeline import backbone as stage
from pipeline.common.cli import run as run_cli
from pipeline.common.config import ConfigError
from pipeline.common.timing import stage_timer
from pipeline.modeling import backbone as bb
from pipeline.modeling import warmup as wu
from pipeline.results.scoring import rouge_summary
from tests.errors import names

DIALOGUES = [
    ([("Amanda", "I baked cookies. Do you want some?"), ("Jerry", "Sure!")], "Amanda baked cookies for Jerry."),
    ([("Tom", "Are we meeting at 5?"), ("Ann", "Yes, at the station.")], "Tom and Ann meet at 5 at the station."),
    ([("Kim", "I lost my keys"), ("Tim", "Check the car"), ("Kim", "Found them!")], "Kim found her keys in the car."),
    ([("Bob", "Pizza tonight?"), ("Eve", "Sure, 8 pm")], "Bob and Eve will have pizza at 8 pm."),
]


def write_interim(path, n_train=4, n_valid=2):
    rows = []
    for split, n in (("train", n_train), ("valid", n_valid)):
        for i in range(n):
            turns, summary = DIALOGUES[i % len(DIALOGUES)]
            rows.append(
                dict(
                    dataset="samsum",
                    domain="SAMSum",
                    split=split,
                    meeting_id=f"{split}{i}",
                    query_index=-1,
                    query="",
                    query_type="none",
                    turns=[{"speaker": s, "content": c} for s, c in turns],
                    spans=[],
                    summary=summary,
                    source_file="fixture",
                    source_line=i + 1,
                )
            )
    # one empty dialogue, as SAMSum train has: skipped, not trained on
    rows.append(dict(rows[0], meeting_id="empty", turns=[], summary="nothing"))
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def local_cfg(name, **warmup):
    cfg = bb.BackboneConfig(name=str(name))
    cfg.warmup = wu.WarmupConfig(**{"eval_examples": 0, **warmup})
    return cfg


# ------------------------------------------------------------------------------------------ local directory
def test_local_directory_is_resolved_recorded_and_gets_one_sep_token(tmp_path):
    src = tiny_models.save_tiny("bart", tmp_path / "src")
    orig_tok = AutoTokenizer.from_pretrained(src)
    orig_len = len(orig_tok)
    # the tiny tokenizer already knows "#SEP#"; a separator it does not know exercises the adding path
    sep = "#BREAK#"
    assert sep not in orig_tok.get_vocab()
    out, report = tmp_path / "out", tmp_path / "reports" / "backbone.json"

    record = bb.resolve(local_cfg(src), sep, out, tmp_path / "interim", report, rouge_summary)

    assert record["source"]["kind"] == "local"
    assert record["source"]["path"] == str(src.resolve())
    assert json.loads((out / bb.RECORD_NAME).read_text()) == json.loads(report.read_text()) == record
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    # the separator is one new token id at the end of the vocabulary, and the embeddings grew to hold it
    assert len(tok) == orig_len + 1 == record["vocab_size"]
    assert tok.convert_tokens_to_ids(sep) == orig_len == record["sep_token_id"]
    assert tok(f"what was said {sep} A: hi")["input_ids"].count(orig_len) == 1
    assert model.get_input_embeddings().num_embeddings >= orig_len + 1
    # the pretrained weights themselves are untouched (no warm-up for a local model)
    orig = AutoModelForSeq2SeqLM.from_pretrained(src)
    name = "model.decoder.layers.0.fc1.weight"
    assert torch.equal(dict(model.named_parameters())[name], dict(orig.named_parameters())[name])
    assert record["warmup"] is None and record["evaluation"] is None
    assert record["decoder_layers"] == orig.config.decoder_layers
    assert record["hidden_size"] == orig.config.d_model


def test_a_tokenizer_saved_padding_left_pads_right_so_a_summary_does_not_depend_on_its_batch(tmp_path):
    """Training's batches are right-padded (batching.collate) and LED's global attention sits on position 0 as a
    source token (model._source); the evaluate stage pads sources on the backbone tokenizer's side. A local backbone
    whose tokenizer was saved padding left (as one prepared for decoder-only generation is) gave BART, whose learned
    positions count pads, a summary that depends on its batch-mates: decoded alone (no padding, the expectation) and
    in a batch of 7 it differed. The stage now saves the backbone's tokenizer padding right."""
    from pipeline.modeling.adapters import AdapterConfig
    from pipeline.modeling.model import AdapterSummarizer
    from pipeline.results.evaluation import EvaluateConfig, generate_per_run

    src = tiny_models.save_tiny("bart", tmp_path / "src")
    config = json.loads((src / "tokenizer_config.json").read_text()) | {"padding_side": "left"}
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(src).padding_side == "left"
    bb.resolve(local_cfg(src), "#SEP#", tmp_path / "out", tmp_path / "interim", tmp_path / "r.json", rouge_summary)
    model = AdapterSummarizer.from_pretrained(tmp_path / "out", AdapterConfig(top_k=2, bottleneck=8, seed=0), "cpu")
    generator = torch.Generator().manual_seed(0)  # W_up away from zero: the adapter changes the summaries
    state = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in model.adapter_state("local").items()}
    sources = [*tiny_models.WORDS, "short", " and ".join(tiny_models.WORDS[:3])]
    cfg = {"num_beams": 3, "max_target_length": 10, "min_target_length": 2}
    summaries = {
        size: generate_per_run(model, [state], [sources], EvaluateConfig(batch_size=size, **cfg), 64, "t")[0]
        for size in (1, len(sources))
    }
    assert summaries[len(sources)] == summaries[1]
    assert model.tokenizer.padding_side == "right"


def test_content_hash_identifies_the_files_not_the_place(tmp_path):
    a = tiny_models.save_tiny("bart", tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert bb.sha256_dir(a) == bb.sha256_dir(b)
    cfg = json.loads((b / "config.json").read_text())
    cfg["dropout"] = 0.25
    (b / "config.json").write_text(json.dumps(cfg))
    assert bb.sha256_dir(a) != bb.sha256_dir(b)


@pytest.mark.parametrize("record", ["[]", "{not json", '{"backbone_sha256": "abc"}'])
def test_a_runs_input_hash_of_a_model_dir_takes_the_records_hash_or_else_the_files(tmp_path, record):
    from pipeline.common.integrity import RECORD_NAME
    from pipeline.training.checkpoints import input_hash

    model_dir = tiny_models.save_tiny("bart", tmp_path / "m")
    (model_dir / RECORD_NAME).write_text(record)  # a record that is not an object, or not JSON, is no hash
    assert input_hash(model_dir) == ("abc" if "sha256" in record else bb.sha256_dir(model_dir))


def test_encoder_only_directory_is_rejected(tmp_path):
    model, tok = tiny_models.tiny_bert2bert()
    model.encoder.save_pretrained(tmp_path / "bert")
    tok.save_pretrained(tmp_path / "bert")
    with pytest.raises(wu.BackboneError, match="not an encoder-decoder"):
        bb.resolve(
            local_cfg(tmp_path / "bert"), "#SEP#", tmp_path / "out", tmp_path, tmp_path / "r.json", rouge_summary
        )
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ hub ids
def test_classify():
    assert bb.classify("minilm-bert2bert") == "recipe"
    assert bb.classify("facebook/bart-base") == "hub"
    assert bb.classify("t5-small") == "hub"
    assert bb.classify(".") == "local"
    with pytest.raises(wu.BackboneError, match="not an existing directory"):
        bb.classify("./no/such/dir")


def test_hub_id_offline_gives_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(wu.BackboneError) as err:
        bb.resolve(
            local_cfg("facebook/bart-base"), "#SEP#", tmp_path / "out", tmp_path, tmp_path / "r.json", rouge_summary
        )
    msg = str(err.value)
    assert "facebook/bart-base" in msg and "cannot be downloaded" in msg
    assert "local directory" in msg and bb.OFFLINE_RECIPE in msg and "HF_HUB_OFFLINE" in msg
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ offline recipe
@pytest.mark.slow
def test_offline_recipe_builds_warms_up_and_records(tmp_path):
    interim = write_interim(tmp_path / "interim" / "samsum.parquet")
    cfg = bb.BackboneConfig()
    cfg.warmup = wu.WarmupConfig(
        steps=2,
        batch_size=2,
        max_source_length=32,
        max_target_length=12,
        log_every=1,
        eval_examples=2,
        eval_batch_size=2,
        length_grouping=0,
    )
    cfg.generation = bb.GenerationDefaults(max_new_tokens=4)
    out = tmp_path / "out"
    record = bb.resolve(cfg, "#SEP#", out, interim.parent, tmp_path / "backbone.json", rouge_summary)

    # build: encoder and decoder both start from MiniLM; the decoder is causal with cross-attention
    model = EncoderDecoderModel.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.decoder.is_decoder and model.config.decoder.add_cross_attention
    assert model.config.decoder.num_hidden_layers == 6 and model.config.decoder.hidden_size == 384
    assert model.config.decoder_start_token_id == tok.cls_token_id
    assert model.generation_config.eos_token_id == tok.sep_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    assert len(tok) == 30522 + 1 == model.config.decoder.vocab_size == record["vocab_size"]
    assert record["sep_token_id"] == 30522 == tok.convert_tokens_to_ids("#SEP#")
    assert any("crossattention" in n for n, _ in model.decoder.named_parameters())

    # warm-up: 2 steps of 2 examples; full-parameter training moved the pretrained weights
    w = record["warmup"]
    assert (w["steps"], w["examples_seen"], w["train_examples"]) == (2, 4, 4)  # the empty dialogue is skipped
    assert [e["step"] for e in w["loss_log"]] == [1, 2]
    minilm = load_file(str(wu.minilm_dir() / "model.safetensors"))
    key = "encoder.layer.5.attention.self.query.weight"
    pretrained = minilm[key] if key in minilm else minilm["bert." + key]
    assert not torch.equal(model.encoder.state_dict()[key], pretrained)
    assert torch.allclose(model.encoder.state_dict()[key], pretrained, atol=1e-2)  # moved, not re-initialised
    ev = record["evaluation"]
    assert ev["examples"] == 2 and ev["decoding"]["max_new_tokens"] == 4
    assert all(0.0 <= ev[k] <= 100.0 for k in ("rouge1", "rouge2", "rougeL"))
    assert json.loads((tmp_path / "backbone.json").read_text()) == record
    # The directory (a DVC output) keeps the record without wall times: a re-run does not change its hash.
    kept = json.loads((out / bb.RECORD_NAME).read_text())
    assert w["seconds"] > 0 and "seconds" not in kept["warmup"] and "seconds" not in kept["evaluation"]
    assert all(set(e) == {"step", "loss"} for e in kept["warmup"]["loss_log"])
    assert kept["warmup"]["loss_log"] == [{"step": e["step"], "loss": e["loss"]} for e in w["loss_log"]]
    assert kept["backbone_sha256"] == record["backbone_sha256"] and kept["parameters"] == record["parameters"]
    # Nothing in the output names the place it was built from (the checkout's .venv), so a clone elsewhere
    # builds the same bytes: config.json names the backbone as params.yaml does.
    for f in out.iterdir():
        assert str(wu.minilm_dir().parent) not in f.read_text(errors="ignore"), f.name
    saved = json.loads((out / "config.json").read_text())
    assert saved["encoder"]["_name_or_path"] == saved["decoder"]["_name_or_path"] == cfg.name


def test_the_backbone_evaluation_scores_each_summary_against_its_own_reference():
    # The slow recipe test checks only 0 <= ROUGE <= 100. evaluate_summarizer generates in length order (b, c, a at
    # batch 2) and must hand the scorer each prediction beside its own reference, in the pairs' order. An echo model
    # summarises a source as itself, so the predictions must be the sources as given, stripped.
    class Batch(dict):
        def to(self, device):
            return self

    class Echo:
        generation_config = type(
            "G", (), {"num_beams": 4, "max_new_tokens": 8, "min_new_tokens": None, "no_repeat_ngram_size": 3}
        )()

        def to(self, device):
            return self

        def eval(self):
            return self

        def generate(self, texts):
            return texts

    tokenizer = lambda texts, **_: Batch(texts=texts)  # noqa: E731
    tokenizer.batch_decode = lambda out, skip_special_tokens: [f" {t} " for t in out]
    pairs = [("a", "the cat sat on the mat today", "ref a"), ("b", "hi", "ref b"), ("c", "one two three", "ref c")]
    seen = []
    score = lambda preds, refs: seen.append((preds, refs)) or {"rouge1": 12.346, "n": 3}  # noqa: E731
    ev = wu.evaluate_summarizer(
        Echo(), tokenizer, pairs, wu.WarmupConfig(eval_batch_size=2), torch.device("cpu"), score
    )
    assert seen == [(["the cat sat on the mat today", "hi", "one two three"], ["ref a", "ref b", "ref c"])]
    assert (ev["examples"], ev["rouge1"], "n" in ev, ev["mean_prediction_words"]) == (3, 12.35, False, 3.67)  # 11 / 3
    assert ev["decoding"] == {"num_beams": 4, "max_new_tokens": 8, "min_new_tokens": 0, "no_repeat_ngram_size": 3}


def test_batch_order_is_seeded_covers_examples_and_groups_by_length():
    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 300, size=200)
    plain = wu.batch_order(lengths, 8, 25, seed=3, group=0)
    assert all(len(b) == 8 for b in plain)
    assert len(np.unique(np.concatenate(plain))) == 200  # one epoch = every example once
    assert all(np.array_equal(x, y) for x, y in zip(plain, wu.batch_order(lengths, 8, 25, seed=3, group=0)))
    assert not all(np.array_equal(x, y) for x, y in zip(plain, wu.batch_order(lengths, 8, 25, seed=4, group=0)))
    grouped = wu.batch_order(lengths, 8, 25, seed=3, group=5)
    assert len(np.unique(np.concatenate(grouped))) == 200
    padded = lambda batches: sum(len(b) * lengths[b].max() for b in batches)  # noqa: E731
    assert padded(grouped) < padded(plain)
    assert len(wu.batch_order(lengths, 8, 60, seed=3, group=0)) == 60  # more steps than one epoch


@pytest.mark.timeout(10)
@pytest.mark.parametrize("group", [0, 3])
def test_batch_order_with_fewer_examples_than_a_batch_fails_instead_of_looping(group):
    # An epoch of 5 examples holds no batch of 8: without the guard the epoch loop never reaches `steps`.
    with pytest.raises(
        ConfigError, match="^backbone.warmup.batch_size=8 is out of range: .*5 examples, fewer than one batch of 8"
    ):
        wu.batch_order(np.arange(5), 8, 10, seed=0, group=group)
    assert wu.batch_order(np.arange(5), 8, 0, seed=0, group=group) == []  # no steps asked: nothing to wait for


def test_new_cross_attention_gets_the_higher_learning_rate():
    model, _ = tiny_models.tiny_bert2bert()
    wc = wu.WarmupConfig(lr=1e-4, cross_attention_lr=5e-4)
    groups = wu.param_groups(model, wc)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        new = [("crossattention" in names[id(p)]) or ("cls.predictions.transform" in names[id(p)]) for p in g["params"]]
        assert all(new) or not any(new)
        assert g["lr"] == (5e-4 if all(new) else 1e-4)
        assert g["weight_decay"] == (0.0 if all(p.ndim < 2 for p in g["params"]) else 0.01)
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in model.parameters() if p.requires_grad)


def test_params_yaml_backbone_group_is_complete():
    from pipeline.common.config import load_params

    cfg, sep = stage.load_config(load_params(Path(__file__).resolve().parents[1] / "params.yaml"))
    assert cfg.name == bb.OFFLINE_RECIPE and sep == "#SEP#"
    assert cfg.warmup.steps > 0 and cfg.warmup.dataset == "samsum"


def test_a_sep_token_that_is_not_text_is_named_before_the_backbone_is_built():
    """`sep_token: #SEP#` unquoted is YAML's null (# starts a comment): the examples stage names it, and so must this
    stage, which DVC may run first; it went on to build the model and ended in transformers' ValueError."""
    from pipeline.common.config import load_params

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    for bad in (None, 5):
        with pytest.raises(ConfigError) as err:
            stage.load_config({**params, "examples": {**params["examples"], "sep_token": bad}})
        names(err.value, "examples.sep_token", repr(bad))


def test_a_warm_up_on_a_corpus_that_shares_meetings_with_an_ingested_one_is_refused():
    """QMSum's Product meetings are AMI's and its Academic ones ICSI's, under other splits (METHOD.md section 2): the
    recipe warmed up on AMI train took QMSum Product test meetings (ES2011, IS1003, TS3004, TS3011) into the backbone.
    Refused in one line when QMSum and AMI or ICSI are ingested; allowed alone, AMI with ICSI (they share no meeting),
    on SAMSum, and for a hub backbone (which is not warmed up)."""
    from pipeline.common.config import load_params

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")

    def config(dataset: str, datasets: list[str], name: str = "minilm-bert2bert"):
        backbone = {**params["backbone"], "name": name, "warmup": {**params["backbone"]["warmup"], "dataset": dataset}}
        return stage.load_config({**params, "backbone": backbone, "ingest": {**params["ingest"], "datasets": datasets}})

    for dataset, datasets, others in [("ami", ["qmsum", "ami"], "['qmsum']"), ("qmsum", ["qmsum", "icsi"], "['icsi']")]:
        with pytest.raises(ConfigError) as err:
            config(dataset, datasets)
        names(err.value, f"backbone.warmup.dataset={dataset!r}", others)
    assert config("ami", ["ami", "samsum"])[0].warmup.dataset == "ami"
    # AMI and ICSI share no meeting (METHOD.md section 2: QMSum's Product meetings are AMI's, its Academic ICSI's)
    assert config("ami", ["samsum", "ami", "icsi"])[0].warmup.dataset == "ami"
    assert config("icsi", ["ami", "icsi"])[0].warmup.dataset == "icsi"
    assert config("samsum", ["qmsum", "samsum", "ami", "icsi"])[0].warmup.dataset == "samsum"
    assert config("ami", ["qmsum", "ami"], name="facebook/bart-base")[0].name == "facebook/bart-base"


# ------------------------------------------------------------------------------------------ timing
def test_stage_timer_writes_record_only_on_success(tmp_path):
    import psutil

    before = time.time() - psutil.Process().create_time()  # this process's age when the stage starts
    with stage_timer("demo", tmp_path):
        _ = [0] * 1000
    after = time.time() - psutil.Process().create_time()
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert set(rec) == {"stage", "seconds", "startup_seconds", "peak_rss_mb", "finished_at"}
    assert rec["stage"] == "demo" and rec["seconds"] >= 0 and rec["peak_rss_mb"] > 0
    # start-up: the process's age at the stage's start (create_time has 10 ms resolution)
    assert before - 0.02 <= rec["startup_seconds"] <= after + 0.02

    @stage_timer("decorated", tmp_path)
    def stage():
        return 7

    assert stage() == 7 and (tmp_path / "decorated.json").is_file()
    with pytest.raises(RuntimeError, match="boom"):
        with stage_timer("failed", tmp_path):
            raise RuntimeError("boom")
    assert not (tmp_path / "failed.json").exists()


def test_a_set_of_experiments_gets_a_short_timing_record_naming_them(tmp_path):
    from pipeline.common.timing import stage_name

    names = [f"fedselectkd-quantile-s{i}-with-a-long-name" for i in range(30)]
    assert stage_name("train", names[:1]) == "train-fedselectkd-quantile-s0-with-a-long-name"
    name = stage_name("train", names)
    assert name.startswith("train-set-of-30-") and len(name) < 40 and name != stage_name("train", names[::-1])
    with stage_timer(name, tmp_path, experiments=names):  # len("+".join(names)) > 255: no such file could be made
        pass
    assert json.loads((tmp_path / f"{name}.json").read_text())["experiments"] == names


def test_cross_attention_can_start_from_the_layers_own_self_attention():
    model, _ = tiny_models.tiny_bert2bert()
    layer = model.decoder.bert.encoder.layer[0]
    assert not torch.equal(layer.crossattention.self.query.weight, layer.attention.self.query.weight)  # random
    wu.init_cross_attention_from_self(model)
    for layer in model.decoder.bert.encoder.layer:  # every layer copied
        for name in ("query", "key", "value"):
            assert torch.equal(
                getattr(layer.crossattention.self, name).weight, getattr(layer.attention.self, name).weight
            )
            assert torch.equal(getattr(layer.crossattention.self, name).bias, getattr(layer.attention.self, name).bias)
        assert torch.equal(layer.crossattention.output.dense.weight, layer.attention.output.dense.weight)
        assert torch.equal(layer.crossattention.output.LayerNorm.weight, layer.attention.output.LayerNorm.weight)
    # copies, not shared tensors: training one leaves the other
    layer.crossattention.self.query.weight.data.add_(1.0)
    assert not torch.equal(layer.crossattention.self.query.weight, layer.attention.self.query.weight)
    with pytest.raises(ValueError, match="cross_attention_init"):
        wu.WarmupConfig(cross_attention_init="zeros")


def test_minilm_weights_can_come_from_a_local_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMEET_MINILM_DIR", str(tmp_path))
    with pytest.raises(wu.BackboneError, match="FEDMEET_MINILM_DIR"):
        wu.minilm_dir()
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert wu.minilm_dir() == tmp_path


def _tiny_warmed_up(pairs, patch=None, **settings):
    """The seeded tiny BERT2BERT (``patch``: a change to it first) after 3 warm-up steps with ``settings``."""
    torch.manual_seed(0)
    model, tok = tiny_models.tiny_bert2bert()
    if patch is not None:
        patch(model)
    wc = wu.WarmupConfig(
        steps=3, batch_size=2, max_source_length=32, max_target_length=12, length_grouping=0, **settings
    )
    wu.warm_up(model, tok, pairs, wc, torch.device("cpu"))
    return model


def _as_transformers_517(model, calls: list) -> None:
    """The model as transformers 5.17 (the lent GPU's) has it: only ``gradient_checkpointing_*``, recorded in
    ``calls``, whose implementation 5.23 keeps as ``_activation_checkpointing_*``."""

    def _absent(self):
        raise AttributeError("not in transformers 5.17")

    def _old(verb):
        return lambda self, *a, **k: calls.append(verb) or getattr(self, f"_activation_checkpointing_{verb}")()

    names = {f"activation_checkpointing_{v}": property(_absent) for v in ("enable", "disable")}
    names |= {f"gradient_checkpointing_{v}": _old(v) for v in ("enable", "disable")}
    model.__class__ = type("EncoderDecoder517", (type(model),), names)
    assert not hasattr(model, "activation_checkpointing_enable")


def test_activation_checkpointing_warms_up_to_the_same_weights(tmp_path):
    """Recomputing activations in backward (with dropout's RNG state restored) changes memory, not a single weight;
    on transformers 5.17 too, through its older name (the backbone stage failed on the lent GPU once)."""
    interim = write_interim(tmp_path / "interim" / "samsum.parquet")
    pairs = bb.load_pairs(interim, "train")
    weights, calls = [], []
    for checkpointing, patch in ((False, None), (True, None), (True, partial(_as_transformers_517, calls=calls))):
        model = _tiny_warmed_up(pairs, patch, activation_checkpointing=checkpointing)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # off again after
        weights.append(model.state_dict())
    assert calls == ["enable", "disable"]
    assert all(w.keys() == weights[0].keys() for w in weights)
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])


def test_warm_up_without_attention_dropout_trains_as_a_model_without_it_and_restores_it(tmp_path):
    """attention_dropout=False trains exactly as a checkpoint whose attention dropout is 0 (so SDPA's fused kernel
    can run), leaves the checkpoint's 0.5 in place afterwards, and differs from training with it on."""
    interim = write_interim(tmp_path / "interim" / "samsum.parquet")
    pairs = bb.load_pairs(interim, "train")
    weights = {}
    for p, keep in ((0.5, False), (0.0, True), (0.5, True)):
        torch.manual_seed(0)
        model, tok = tiny_models.tiny_bert2bert()  # its attention dropout is 0
        attention = [m for m in model.modules() if type(m).__name__ in ("BertSelfAttention", "BertCrossAttention")]
        assert len(attention) == 2 + 3 * 2  # encoder self; decoder self and cross
        for m in attention:
            m.dropout.p = p
        wc = wu.WarmupConfig(
            steps=3, batch_size=2, max_source_length=32, max_target_length=12, length_grouping=0, attention_dropout=keep
        )
        wu.warm_up(model, tok, pairs, wc, torch.device("cpu"))
        assert all(m.dropout.p == p for m in attention)
        weights[p, keep] = model.state_dict()
    off, never, on = weights[0.5, False], weights[0.0, True], weights[0.5, True]
    assert all(torch.equal(off[k], never[k]) for k in off)
    assert not all(torch.equal(off[k], on[k]) for k in off)


def test_fused_adamw_is_the_loops_update_up_to_rounding_and_false_is_the_loop(tmp_path, monkeypatch):
    """fused_adamw=False builds torch's default per-tensor AdamW (the presets' committed backbones were trained with
    it); True asks for the fused kernel, whose weights after 3 steps agree with the loop's to float32 rounding."""
    interim = write_interim(tmp_path / "interim" / "samsum.parquet")
    pairs = bb.load_pairs(interim, "train")
    asked, adamw = [], torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **kw: asked.append(kw.get("fused")) or adamw(*a, **kw))
    weights = {fused: _tiny_warmed_up(pairs, fused_adamw=fused).state_dict() for fused in (False, True)}
    assert asked == [False, True]
    assert all(torch.allclose(weights[False][k], weights[True][k], rtol=1e-5, atol=1e-6) for k in weights[False])


def test_a_local_backbone_resolved_twice_is_the_same_bytes_whatever_ran_before(tmp_path):
    # A separator the tokenizer lacks grows the embeddings; transformers draws the new row from a normal around
    # the old rows' mean, from the global RNG: the stage must seed it, or every run writes other weights.
    src = tiny_models.save_tiny("bart", tmp_path / "src")
    records = []
    for rng_state in (1, 2):
        torch.manual_seed(rng_state)  # whatever ran before the stage in this process
        out = tmp_path / f"out{rng_state}"
        records.append(bb.resolve(local_cfg(src), "#BREAK#", out, tmp_path / "i", tmp_path / "r.json", rouge_summary))
    a, b = (load_file(str(tmp_path / f"out{s}" / "model.safetensors")) for s in (1, 2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records[0]["backbone_sha256"] == records[1]["backbone_sha256"]


def test_a_warmup_dataset_without_the_split_it_needs_is_one_error_line(tmp_path, capsys):
    # backbone.warmup.dataset's records lack the valid split (ingest.allow_absent_splits may allow that)
    src = tiny_models.save_tiny("bart", tmp_path / "src")
    interim = write_interim(tmp_path / "interim" / "samsum.parquet", n_valid=0)
    params = {"ingest": {"datasets": ["samsum"]}, "backbone": {"warmup": {"eval_examples": 2}}}
    (tmp_path / "params.yaml").write_text(json.dumps(params))  # YAML reads JSON
    capsys.readouterr()  # what saving the tiny backbone printed
    args = ["--params", str(tmp_path / "params.yaml"), "--name", str(src), "--out", str(tmp_path / "out")]
    args += ["--report", str(tmp_path / "r.json"), "--interim-dir", str(interim.parent)]
    assert run_cli(stage.main, args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "it/s]" not in line and line.strip()]
    assert err == [f"error: {interim}: no records with split == 'valid'"]


def test_warmup_lengths_beyond_the_backbones_positions_are_one_config_error(tmp_path, capsys):
    # the tiny BART has 256 positions (tests/tiny_models.py); a validation dialogue of ~400 tokens reaches them
    src = tiny_models.save_tiny("bart", tmp_path / "src")
    interim = write_interim(tmp_path / "interim" / "samsum.parquet")
    df = pd.read_parquet(interim)
    df["turns"] = [[{"speaker": "A", "content": "the remote control design " * 100}]] * len(df)
    df.to_parquet(interim)
    cfg = local_cfg(src, eval_examples=1, max_source_length=257)
    with pytest.raises(ConfigError, match=r"^backbone\.warmup\.max_source_length=257 is out of range; allowed: <= 256"):
        bb.resolve(cfg, "#SEP#", tmp_path / "out", interim.parent, tmp_path / "r.json", rouge_summary)
    cfg.warmup.max_source_length = 256  # the largest the table holds: scored
    record = bb.resolve(cfg, "#SEP#", tmp_path / "out", interim.parent, tmp_path / "r.json", rouge_summary)
    assert record["evaluation"]["examples"] == 1


def test_generation_max_new_tokens_beyond_the_decoders_positions_is_one_config_error(tmp_path):
    # the tiny BART's decoder has 256 positions: the warm-up's scoring decodes up to generation.max_new_tokens
    src = tiny_models.save_tiny("bart", tmp_path / "src")
    interim = write_interim(tmp_path / "interim" / "samsum.parquet")
    cfg = local_cfg(src, eval_examples=1)
    cfg.generation = bb.GenerationDefaults(max_new_tokens=300, min_new_tokens=300)
    with pytest.raises(
        ConfigError, match=r"^backbone\.generation\.max_new_tokens=300 is out of range; allowed: <= 256"
    ):
        bb.resolve(cfg, "#SEP#", tmp_path / "out", interim.parent, tmp_path / "r.json", rouge_summary)
