"""The deployed ClientApp (pyproject.toml ``clientapp``): pipeline.federation.client_app's ``client_app`` plus
federated evaluation, ``query.summarize``. Kept apart so the train stage's engines do not import decoding and
scoring code (editing it reruns no training).
"""
from __future__ import annotations

import json
import math

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from pipeline.common.config import from_dict
from pipeline.datasets.subsampling import subsample_test_ids
from pipeline.federation.client_app import client_app, client_dir, client_name
from pipeline.federation.protocol import CONFIG_KEY, METRICS_KEY, load_plan, plan_path_of
from pipeline.modeling.adapters import adapter_file, load_local_adapter
from pipeline.modeling.generation import generate_summaries
from pipeline.results.evaluation import EvaluateConfig
from pipeline.results.scoring import Scorer, mean_scores
from pipeline.training.client_data import read_examples, read_partition
from pipeline.training.shared_model import model_config, shared_model

__all__ = ["client_app", "client_summarize"]  # Flower finds pyproject's `client_evaluation:client_app` in __all__

@client_app.query("summarize")
def client_summarize(msg: Message, context: Context) -> Message:
    """Federated evaluation (pipeline.federation.deployment): ROUGE of the client's own adapter on its own test
    set, as the evaluate stage computes it; replies numbers only (the summaries never leave the client)."""
    plan = load_plan(plan_path_of(msg, context))
    name = client_name(plan, context)
    cfg = from_dict(EvaluateConfig, json.loads(str(msg.content[CONFIG_KEY]["evaluate"])),
                    "query.summarize: evaluate")
    partition = read_partition(plan.paths["partition"])
    if name not in partition["clients"]:
        raise ValueError(f"{plan.paths['partition']}: no client {name!r}")
    test_ids = [str(i) for i in partition["clients"][name].get("test", [])]
    metrics: dict[str, float | int] = {"n_test": len(test_ids)}
    if test_ids:
        examples = read_examples(plan.paths["examples"])
        missing = [i for i in test_ids if i not in examples.index]
        if missing:
            raise ValueError(f"{plan.paths['partition']}: client {name!r} test id {missing[0]!r} is not in "
                             f"{plan.paths['examples']} ({len(missing)} missing)")
        chosen = subsample_test_ids(test_ids, name, cfg.test_examples_per_client, cfg.subsample_seed)
        model = shared_model(plan)
        load_local_adapter(model, adapter_file(client_dir(plan, name, context), cfg.adapter))
        sub = examples.loc[chosen]
        max_src = cfg.max_source_length or model_config(plan).max_source_length
        predictions = generate_summaries(model, sub["source"].tolist(), cfg, max_src, desc=f"{plan.experiment}/{name}")
        metrics.update(mean_scores(Scorer(use_stemmer=True).score_pairs(predictions, sub["target"].tolist())))
        metrics["skipped_by_subsampling"] = len(test_ids) - len(chosen)
    content = RecordDict({"identity": ConfigRecord({"client-name": name}),
                          METRICS_KEY: MetricRecord({k: v for k, v in metrics.items()
                                                         if not (isinstance(v, float) and math.isnan(v))})})
    return Message(content, reply_to=msg)
