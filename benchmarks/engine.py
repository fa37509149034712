"""The set engine side by side (issue 53): the same set of runs trained one at a time and together, on this
machine, with the real MiniLM-L6 BERT2BERT backbone (random cross-attention: no warm-up, a speed measurement).

    python -m benchmarks.engine                 # -> reports/bench/engine.json, reports/bench/engine.md
    python -m benchmarks.engine --profile       # cProfile of one round of a two-path arm (fedselectkd), top lines

The workspace is built in a temporary directory like the repo's: QMSum's real meetings and queries from
/work/shared/data (``pipeline.datasets.readers.qmsum``; the source text as the examples stage writes it), three
domain clients with the CPU profile's caps (params.yaml: 16 train and 6 valid examples a client), params.yaml's
``model`` and ``train`` groups. "Alone" trains each run by itself (``run_set([plan])``), "together" all of them as one
set (``run_set(plans)``); the two alternate ``--repeats`` times, so load from other processes hits both. The floor
is benchmarks/flops.py's forward + backward FLOPs of the adapted layers and LM head per trained and validated
target token (prefix cached, as the runs train), at this machine's measured fp32 matmul rate.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import pandas as pd  # noqa: E402

QMSUM = Path("/work/shared/data/qmsum")
CLIENTS = {"Academic": "academic", "Committee": "committee", "Product": "product"}
SET = ("fedavg", "fedkd", "fedselectkd")  # one-path and two-path arms, the same seed: they share micro-batches


def _examples(n_train: int, n_valid: int, sep_token: str) -> tuple[pd.DataFrame, dict[str, dict[str, list[str]]]]:
    from pipeline.common.schema import IngestReport, model_input
    from pipeline.datasets.readers.qmsum import read_qmsum

    rows, clients = [], {}
    records = list(read_qmsum(QMSUM, IngestReport("qmsum", str(QMSUM))))
    for client, domain in CLIENTS.items():
        splits: dict[str, list[str]] = {"train": [], "valid": [], "test": []}
        for split, n in (("train", n_train), ("valid", n_valid)):
            mine = [r for r in records if r.domain == client and r.split == split][:n]
            for r in mine:
                eid = f"qmsum/{domain}/{split}/{r.meeting_id}/{r.query_type[0]}{r.query_index}"
                rows.append(
                    {
                        "example_id": eid,
                        "dataset": "qmsum",
                        "domain": client,
                        "split": split,
                        "source": model_input(r.query, r.turns, sep_token),
                        "target": r.summary,
                    }
                )
                splits[split].append(eid)
        clients[client] = splits
    return pd.DataFrame(rows), clients


def build_workspace(root: Path, params_path: str = "params.yaml", tiny: bool = False) -> dict[str, Any]:
    """A repo-like workspace under ``root`` (backbone, examples, partition, params); returns the params read.
    ``tiny``: the tests' tiny BART (tests/tiny_models.py) instead of MiniLM, with its own model shape."""
    from pipeline.backbone import add_sep_token
    from pipeline.common.config import load_params
    from pipeline.modeling.warmup import build_bert2bert, minilm_dir

    params = load_params(params_path)
    sep_token = (params.get("examples") or {}).get("sep_token", "#SEP#")
    if tiny:
        from tests.tiny_models import MODEL, save_tiny

        save_tiny("bart", root / "models" / "backbone")
        params = {**params, "model": {**params["model"], **MODEL}}
    else:
        model, tokenizer = build_bert2bert(minilm_dir())
        add_sep_token(model, tokenizer, sep_token)
        model.save_pretrained(root / "models" / "backbone")
        tokenizer.save_pretrained(root / "models" / "backbone")
    train = params["train"]
    examples, clients = _examples(
        train["max_train_examples_per_client"], train["max_valid_examples_per_client"], sep_token
    )
    (root / "data" / "processed").mkdir(parents=True, exist_ok=True)
    examples.to_parquet(root / "data" / "processed" / "examples.parquet", index=False)
    partition = root / "data" / "partitions" / "domain" / "seed0.json"
    partition.parent.mkdir(parents=True, exist_ok=True)
    excluded = {"count": 0, "by_reason": {}, "example_ids": []}
    partition.write_text(
        json.dumps({"scheme": "domain", "seed": 0, "params": {}, "clients": clients, "excluded": excluded})
    )
    (root / "params.yaml").write_text(json.dumps({"train": {"engine": "inprocess", "round_timeout_s": 86400}}))
    return params


def write_plans(root: Path, params: dict[str, Any], methods: tuple[str, ...], rounds: int) -> list[Path]:
    from pipeline.experiments import Experiment, resolve_plan
    from pipeline.training.methods import get_method

    run_params = {**params, "train": {**params["train"], "rounds": rounds, "stop": {"enabled": False}}}
    paths = []
    for method in methods:
        tau = params.get("tau", 5.0) if get_method(method).uses_tau else None
        entry = Experiment(
            name=f"bench-{method}", method=method, partition="domain/seed0", seed=0, study="bench", tau=tau
        )
        path = root / "models" / "plans" / f"bench-{method}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(resolve_plan(entry, run_params), indent=2, sort_keys=True))
        paths.append(path)
    return paths


def profile_round(root: Path, params: dict[str, Any], top: int = 30, dump: str | None = None) -> str:
    """cProfile of one round of the two-path arm (prefix cache already filled by a first run)."""
    from pipeline.train import run_packed as run_set

    (plan,) = write_plans(root, params, ("fedselectkd",), rounds=1)
    run_set([plan], track=False)  # fills the prefix cache, as every round after the first finds it
    profiler = cProfile.Profile()
    profiler.enable()
    run_set([plan], track=False)
    profiler.disable()
    if dump:
        profiler.dump_stats(dump)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one two-path round and exit")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny BART instead of MiniLM (with --profile)")
    ap.add_argument("--dump", default=None, help="with --profile: write the cProfile stats file here")
    ap.add_argument("--work", default=None, help="workspace directory (default: a temporary one)")
    args = ap.parse_args(argv)
    project = Path.cwd()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="engine-bench-"))
    params = build_workspace(work, str(project / "params.yaml"), tiny=args.tiny)
    os.chdir(work)
    os.environ["FEDMEET_ROOT"] = str(work)
    try:
        if args.profile:
            print(profile_round(work, params, dump=args.dump))
            return
    finally:
        os.chdir(project)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
