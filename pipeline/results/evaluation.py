"""An evaluation as the evaluate stage and the deployed clients' federated evaluation make it: the decoding
settings (the `evaluate` params), the summaries they generate, and the evaluation's MLflow record (the client
averages as headline metrics, each client's scores in its client's run, the training run it belongs to), with the
catalog of studies that describes each study's MLflow experiment. Training never imports it: rewording a study
reruns no training."""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from pydantic import model_validator

from pipeline.common.config import NonNegativeInt, PositiveInt, TokenLength, check_lengths, config
from pipeline.common.schema import DataError
from pipeline.experiments.plans import record_hash
from pipeline.results.scoring import SCORE_KEYS, TABLE_ROUGE_L
from pipeline.results.tracking import RunLogger, experiment_id, find_runs


@config
class EvaluateConfig:
    adapter: Literal["best", "final"] = "best"
    batch_size: PositiveInt = 8
    num_beams: PositiveInt = 1
    max_target_length: PositiveInt = 96
    min_target_length: NonNegativeInt = 10
    no_repeat_ngram_size: NonNegativeInt = 3
    length_penalty: float = 1.0
    max_source_length: TokenLength | None = None
    test_examples_per_client: PositiveInt | None = 8  # null = all
    subsample_seed: int = 0
    log_text_to_mlflow: bool = False

    @model_validator(mode="after")
    def _min_below_max(self) -> EvaluateConfig:
        if self.min_target_length > self.max_target_length:
            raise ValueError(
                f"min_target_length={self.min_target_length} must be <= max_target_length={self.max_target_length}"
            )
        return self

    def generation_kwargs(self) -> dict[str, Any]:
        return {
            "num_beams": self.num_beams,
            "max_new_tokens": self.max_target_length,
            "min_new_tokens": self.min_target_length,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "length_penalty": self.length_penalty,
            "early_stopping": True,
            "do_sample": False,
        }


def metrics_record(plan: Any, backbone: str, cfg: EvaluateConfig, per_client: dict, skipped_clients: dict) -> dict:
    """What metrics.json holds of an evaluation of ``plan`` (a Plan), made by the evaluate stage or by the deployed
    clients: the plan's identity, the decoding, each client's scores (by client) and their mean over clients
    (unweighted, as the paper averages its per-client columns; None without a client), the skipped clients' reasons."""
    return {
        **{key: getattr(plan, key) for key in ("experiment", "method", "partition", "seed", "study")},
        "backbone": backbone,
        "adapter": cfg.adapter,
        "decoding": {k: v for k, v in asdict(cfg).items() if k not in ("adapter", "log_text_to_mlflow")}
        | {"max_source_length": cfg.max_source_length or plan.model_config.max_source_length},
        "rouge_l_in_tables": TABLE_ROUGE_L,
        "clients": per_client,
        "skipped_clients": skipped_clients,
        "mean": {
            k: sum(c[k] for c in per_client.values()) / len(per_client) if per_client else None for k in SCORE_KEYS
        },
    }


def test_subsample(examples, test_ids: list[str], client: str, cfg: EvaluateConfig, where: str):
    """The client's test subsample (rows of ``examples``, indexed by example id; ``where`` names the partition and
    examples files): at most `test_examples_per_client` ids, drawn with a seed that depends only on (subsample_seed,
    client), in partition order: every method evaluated on the same partition sees the same examples (paired
    comparisons, case study, human evaluation). The draw must stay as it is: it fixes which examples a recorded score
    was computed on."""
    if missing := [i for i in test_ids if i not in examples.index]:
        raise DataError(f"{where}: client {client!r}: {len(missing)} test ids not in the examples, e.g. {missing[:3]}")
    if (k := cfg.test_examples_per_client) is not None and k < len(test_ids):
        chosen = set(random.Random(f"evaluate:{cfg.subsample_seed}:{client}").sample(sorted(test_ids), k))
        test_ids = [i for i in test_ids if i in chosen]
    return examples.loc[list(test_ids)]


# Sources a generate call holds at most (several experiments' adapters stacked). Its memory grows with them x beams:
# at MiniLM's shapes (512-token sources, 4 beams) the cross-attention caches alone take ~19 GB for 512 sources.
GENERATE_ROWS = 512


def generate_per_run(
    model, adapters: list[dict], sources: list[list[str]], cfg: EvaluateConfig, max_source_length: int, desc: str
) -> list[list[str]]:
    """Each run's beam-search summaries of its own sources (run r: adapter state ``adapters[r]``, as
    ``AdapterSet.state()`` gives it, on ``sources[r]``), per run what its adapter alone gives. The i-th batch of
    ``cfg.batch_size`` sources of every run that has one is generated in ``generate`` calls of the runs whose i-th
    batch has the same length, the runs' adapters stacked on run-major blocks of that size
    (pipeline.modeling.adapter_stack), at most ``GENERATE_ROWS`` rows a call (the runs beyond them in the next call):
    no row is padding (the GPU study's clients of 49, 66 and 129 sources in batches of 64: 244 rows an experiment,
    not 321 with calls of the runs in their order, a short batch filled to its call's widest)."""
    import torch  # lazy: torch (~1 s); the federation CLI imports this module without it
    from tqdm import tqdm  # lazy, as above

    from pipeline.modeling.adapter_stack import AdapterStack  # lazy, as above: it imports torch

    tokenizer, size = model.tokenizer, cfg.batch_size
    check_lengths(model.backbone, max_source_length, cfg.max_target_length, "evaluate")  # new tokens: decoder positions
    stacks: dict[tuple[int, ...], AdapterStack] = {}  # by the runs a call holds
    outputs: list[list[str]] = [[] for _ in adapters]
    with torch.no_grad():
        calls: list[tuple[int, tuple[int, ...]]] = []  # (first source, the runs)
        for start in range(0, max(map(len, sources)), size):
            length = {r: len(s[start : start + size]) for r, s in enumerate(sources) if start < len(s)}
            for width, same in itertools.groupby(sorted(length, key=lambda r: -length[r]), key=length.get):
                runs, per_call = list(same), max(1, GENERATE_ROWS // width)  # runs a call holds
                calls += [(start, tuple(runs[i : i + per_call])) for i in range(0, len(runs), per_call)]
        for start, runs in tqdm(calls, desc=desc, unit="call", leave=False):
            rows = [text for r in runs for text in sources[r][start : start + size]]  # each run's: one length
            if runs not in stacks:  # its leaves require grad, but no graph is built under no_grad
                stacks[runs] = AdapterStack([adapters[r] for r in runs], model.adapter_sets["local"], model.device)
            enc = tokenizer(rows, max_length=max_source_length, truncation=True, padding=True, return_tensors="pt")
            ids = model.generate(enc["input_ids"], enc["attention_mask"], stacks[runs], **cfg.generation_kwargs())
            texts = [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
            width = len(rows) // len(runs)
            for j, r in enumerate(runs):
                outputs[r].extend(texts[j * width : (j + 1) * width])
    return outputs


# study -> (what it compares, METHOD.md section)
STUDIES: dict[str, tuple[str, str]] = {
    "main": (
        "Main tables: 3 QMSum domain clients x 5 methods (AdaSingle, AdaCentralized, AdaFedAvg, AdaFedKD, AdaFedSelectKD)",
        "7.1 (methods: section 6)",
    ),
    "iid": ("IID and balanced: each client gets a third of every domain; FedAvg vs FedKD vs SelectKD", "7.2"),
    "noniid": ("Non-IID and balanced: per domain 200 train / 40 valid / 40 test per seed", "7.3"),
    "extreme": ("Extreme non-IID and unbalanced: SAMSum as a 4th client, with and without it", "7.4"),
    "sampling": ("Client sampling: 2 of 3 clients chosen at random each round", "7.5"),
    "tau_sweep": ("Entropy threshold sweep over tau (selective KD gate, section 4)", "7.6"),
    "server": ("Server algorithms: FedAvg, FedProx, FedOPT, FedNova vs SelectKD", "7.7 (server: section 5)"),
    "new_client": ("New client: SAMSum joins after the QMSum clients converged (post) vs from the start (pre)", "7.8"),
    "hardkd": ("Noun-verb hard KD vs SelectKD", "7.10 (POS analysis: 7.9)"),
    "privacy": (
        "Privacy vs utility: the same methods without and with differential privacy at several epsilon "
        "(the paper names DP as its next step)",
        "(none: beyond the paper; README 'Privacy')",
    ),
}


def study_description(study: str) -> str:
    """The description of a study's MLflow experiment (an unlisted study by its name, section 7)."""
    what, section = STUDIES.get(study, (f"Study {study!r} (experiments with study: {study})", "7"))
    return (
        f"fedmeet study `{study}`: {what}. METHOD.md section {section}. One run per experiment of the "
        "`experiments` params (with the DVC experiment's name under `dvc exp run`). Compare methods "
        "on client_avg/ROUGE-1, ROUGE-2, ROUGE-L (plain rougeL, as in the tables) and avg_ROUGE, each with its "
        "interval (_ci_low/_ci_high; its level and how it was drawn: ci in the run's metrics.json); per client: its "
        "child run and its adapter's LoggedModel (Models tab)."
    )


# The tables' headline numbers under one "<prefix>/" name: MLflow's chart view groups such metrics into a section
# listed before the others, so the compare view opens on the client averages ranked across runs.
HEADLINE_PREFIX = "client_avg"
HEADLINE_KEYS = {"ROUGE-1": "rouge1", "ROUGE-2": "rouge2", "ROUGE-L": TABLE_ROUGE_L, "avg_ROUGE": "avg_rouge"}


def log_to_mlflow(
    experiment: dict[str, Any],
    metrics: dict[str, Any],
    eval_dir: Path,
    cfg: EvaluateConfig,
    converged: bool | None = None,
    test_sets: dict[str, Any] | None = None,
    run_tags: dict[str, str] | None = None,
) -> str:
    """Log an evaluation into its training run (of its plan record ``experiment``, or the one an imported record's
    ``run_tags`` name; else a new run): ``client_avg/*``, and each client's ROUGE into its client's run, on its
    adapter's LoggedModel and its ``test_sets`` dataset; the tag ``converged`` is readers.run_converged. Run id."""
    name, study = metrics["experiment"], str(experiment.get("study") or "main")
    exp_id = experiment_id(study, study_description(study))  # the study's description, which training does not set
    run_id = experiment.get("mlflow_run_id")
    if not run_id:  # the train stage's latest run of these tags (default: of exactly this plan), if they name one
        # plan (two ablation points share a name, method, partition and seed; runs of imported records have no plan)
        identity = {"experiment": name} | ({"plan_hash": record_hash(experiment)} if run_tags is None else run_tags)
        where = " and ".join(f"tags.{k} = '{v}'" for k, v in identity.items()) + " and tags.plan_hash LIKE '%'"
        runs = find_runs(exp_id, where, order_by=["attributes.start_time DESC"])
        run_id = runs[0].info.run_id if len({r.data.tags["plan_hash"] for r in runs}) == 1 else None
    if run_id:
        logger = RunLogger(run_id)
    else:  # a record with no training run found (imported: none, or several plans): a run of its own, tagged as it says
        keys = ("method", "partition", "seed", "study", "tau")
        tags = {k: str(experiment[k]) for k in keys if experiment.get(k) is not None}
        logger = RunLogger.start(study, name, {}, {"experiment": name, **tags}, clients=tuple(metrics["clients"]))
    # client_avg/<ROUGE-1|ROUGE-2|ROUGE-L|avg_ROUGE>, with the mean_ci interval as _ci_low/_high
    headline = {}
    for label, key in HEADLINE_KEYS.items():
        headline[f"{HEADLINE_PREFIX}/{label}"] = float("nan" if (v := metrics["mean"][key]) is None else v)  # no client
        interval = (metrics.get("mean_ci") or {}).get(key) or {}  # {"low": ..., "high": ...}
        headline |= {f"{HEADLINE_PREFIX}/{label}_ci_{end}": float(value) for end, value in interval.items()}
    logger.log_metrics(headline, step=0)
    # The record's evaluation settings as tags, not params: MLflow forbids changing a param, and re-evaluating a
    # trained run with other decoding settings (`dvc exp run -S evaluate.num_beams=2`) logs into the same run.
    settings = {"adapter": metrics.get("adapter", cfg.adapter)} | (metrics.get("decoding") or {})
    logger.set_tags(
        {f"evaluate.{k}": v for k, v in settings.items()}
        | {"rouge_l_in_tables": TABLE_ROUGE_L}
        | ({"backbone": metrics["backbone"]} if metrics.get("backbone") else {})
        | ({} if converged is None else {"converged": str(bool(converged)).lower()})
    )
    models = logger.models if settings["adapter"] == "best" else {}  # the logged models are the best adapters
    for client, scores in metrics["clients"].items():
        client_scores = {f"{client}.{k}": scores[k] for k in SCORE_KEYS}
        logger.log_metrics(client_scores, 0, models.get(client), (test_sets or {}).get(client))
    logger.log_artifact(eval_dir / "metrics.json", artifact_path="eval")
    if cfg.log_text_to_mlflow and (eval_dir / "predictions.jsonl").is_file():  # federated: the text stayed on clients
        logger.log_artifact(eval_dir / "predictions.jsonl", artifact_path="eval")
    if not run_id:
        logger.finish()
    return logger.run_id
