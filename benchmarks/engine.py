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
import platform
import pstats
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from benchmarks import flops  # noqa: E402
from benchmarks.common import Shape, default_shape, matmul_peak, write_json  # noqa: E402

QMSUM = Path("/work/shared/data/qmsum")
CLIENTS = {"Academic": "academic", "Committee": "committee", "Product": "product"}
SET = ("fedavg", "fedkd", "fedselectkd")  # one-path and two-path arms, the same seed: they share micro-batches


def _examples(
    n_train: int | None, n_valid: int | None, sep_token: str, qmsum: Path = QMSUM, n_test: int | None = 0
) -> tuple[pd.DataFrame, dict[str, dict[str, list[str]]]]:
    from pipeline.common.schema import IngestReport, model_input
    from pipeline.datasets.readers.qmsum import read_qmsum

    rows, clients = [], {}
    records = list(read_qmsum(qmsum, IngestReport("qmsum", str(qmsum))))
    for client, domain in CLIENTS.items():
        splits: dict[str, list[str]] = {"train": [], "valid": [], "test": []}
        for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
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


def build_workspace(
    root: Path, params_path: str = "params.yaml", tiny: bool = False, qmsum: Path = QMSUM, n_test: int | None = 0
) -> dict[str, Any]:
    """A repo-like workspace under ``root`` (backbone, examples, partition, params); returns the params read.
    ``tiny``: the tests' tiny BART (tests/tiny_models.py) instead of MiniLM, with its own model shape. ``n_test``
    test examples a client (None: all) go into the partition too."""
    from pipeline.common.config import load_params
    from pipeline.modeling.backbone import add_sep_token
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
        train["max_train_examples_per_client"], train["max_valid_examples_per_client"], sep_token, qmsum, n_test
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


def write_plans(
    root: Path, params: dict[str, Any], methods: tuple[str, ...], rounds: int, prefix: str = "bench"
) -> list[Path]:
    from pipeline.experiments.entries import Experiment
    from pipeline.experiments.methods import get_method
    from pipeline.planning import resolve_plan

    run_params = {**params, "train": {**params["train"], "rounds": rounds, "stop": {"enabled": False}}}
    paths = []
    for method in methods:
        tau = params.get("tau", 5.0) if get_method(method).uses_tau else None
        entry = Experiment(
            name=f"{prefix}-{method}", method=method, partition="domain/seed0", seed=0, study="bench", tau=tau
        )
        path = root / "models" / "plans" / f"{prefix}-{method}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(resolve_plan(entry, run_params), indent=2, sort_keys=True))
        paths.append(path)
    return paths


def profile_round(root: Path, params: dict[str, Any], top: int = 30, dump: str | None = None) -> str:
    """cProfile of one round of the two-path arm (prefix cache already filled by a first run)."""
    from pipeline.train import run_set

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


def round_flops(plan_path: Path, shape: Shape) -> float:
    """Matmul FLOPs of one round of the plan at its real lengths: every client's train examples once (prefix cached:
    forward of the top k layers and head, twice with a teacher, and the backward), its valid examples forward once."""
    from dataclasses import replace

    from pipeline.experiments.plans import read_plan
    from pipeline.modeling.batching import tokenize_pairs
    from pipeline.training.client_data import client_data, client_names
    from pipeline.training.client_training import kd_config
    from pipeline.training.shared_model import shared_model

    plan = read_plan(plan_path)
    model, mcfg = shared_model(plan), plan.model_config
    paths = 1 if kd_config(plan).mode == "ce" else 2
    total = 0.0
    for client in client_names(plan):
        data = client_data(plan, client)
        for frame, train in ((data.train, True), (data.valid, False)):
            pairs = tokenize_pairs(model.tokenizer, frame, mcfg, model.decoder_start_token_id)
            for ex in pairs:
                s = replace(shape, source_length=len(ex.input_ids), target_length=len(ex.labels), batch_size=1)
                total += paths * flops.top_path(s) + flops.backward(s) if train else flops.top_path(s)
    return total


def _published(names: list[str]) -> dict[str, dict[str, Any]]:
    from safetensors.torch import load_file

    out = {}
    for name in names:
        metrics = json.loads(Path(f"reports/train/{name}/metrics.json").read_text())
        adapters = {
            f"{d.name}/{k}": v
            for d in sorted(Path(f"models/{name}/clients").iterdir())
            for k, v in load_file(d / "adapter_final.safetensors").items()
        }
        rounds = {c: (m["best_round"], metrics["stopped_round"]) for c, m in metrics["clients"].items()}
        out[name] = {"adapters": adapters, "rounds": rounds}
        shutil.rmtree(Path("models") / name)
        shutil.rmtree(Path("reports/train") / name)
    return out


def side_by_side(root: Path, params: dict[str, Any], rounds: int, repeats: int) -> dict[str, Any]:
    """The set trained one run at a time and together, alternating; the floor from the FLOPs and the matmul peak."""
    from pipeline.experiments.plans import read_plan
    from pipeline.train import run_set
    from pipeline.training import local_batch

    plans = write_plans(root, params, SET, rounds)
    names = [p.stem for p in plans]
    warm = write_plans(root, params, ("fedavg",), rounds=1, prefix="warmup")
    run_set(warm, track=False)  # fills the prefix cache on disk: every run after reads it, as rounds 2.. do
    shape = default_shape(read_plan(plans[0]).model_config, 1)
    run_flops = {p.stem: round_flops(p, shape) * rounds for p in plans}
    timings: dict[str, list[float]] = {"alone": [], "together": []}
    cpu: dict[str, list[float]] = {"alone": [], "together": []}  # this process's CPU time: less of others' load
    peaks = []
    outcome = {}
    stacked = {mode: {"groups": 0, "runs_stacked": 0} for mode in timings}  # client rounds trained per group
    for r in range(repeats):
        peaks.append(matmul_peak((1024, 2048), 3)["peak_gflops"])  # the load changes: the best rate seen counts
        for mode in ("alone", "together") if r % 2 == 0 else ("together", "alone"):
            start, start_cpu, before = time.perf_counter(), time.process_time(), dict(local_batch.STATS)
            for group in [[p] for p in plans] if mode == "alone" else [plans]:
                run_set(group, track=False)
            timings[mode].append(time.perf_counter() - start)
            for key in stacked[mode]:
                stacked[mode][key] += local_batch.STATS[key] - before[key]
            cpu[mode].append(time.process_time() - start_cpu)
            outcome[mode] = _published(names)
    diff = max(
        float((outcome["alone"][n]["adapters"][k] - outcome["together"][n]["adapters"][k]).abs().max())
        for n in names
        for k in outcome["alone"][n]["adapters"]
    )
    run_rounds = len(plans) * rounds
    floor = sum(run_flops.values()) / (max(peaks) * 1e9)
    return {
        "device": f"cpu: {platform.machine()}, {os.cpu_count()} cores (shared), {torch.get_num_threads()} torch threads",
        "runs": names,
        "rounds_per_run": rounds,
        "repeats": repeats,
        "seconds_alone": round(min(timings["alone"]), 2),
        "seconds_together": round(min(timings["together"]), 2),
        "seconds_alone_all": [round(t, 2) for t in timings["alone"]],
        "seconds_together_all": [round(t, 2) for t in timings["together"]],
        "cpu_seconds_alone_all": [round(t, 2) for t in cpu["alone"]],
        "cpu_seconds_together_all": [round(t, 2) for t in cpu["together"]],
        "floor_seconds": round(floor, 2),
        "seconds_per_run_round": {
            "alone": round(min(timings["alone"]) / run_rounds, 2),
            "together": round(min(timings["together"]) / run_rounds, 2),
            "floor": round(floor / run_rounds, 3),
        },
        "flops_per_run": {n: f for n, f in run_flops.items()},
        "matmul_peak_gflops": max(peaks),
        "matmul_gflops_all": peaks,
        "runs_per_group": {m: round(c["runs_stacked"] / max(c["groups"], 1), 2) for m, c in stacked.items()},
        "max_abs_adapter_diff": diff,
        "same_rounds": all(outcome["alone"][n]["rounds"] == outcome["together"][n]["rounds"] for n in names),
    }


def markdown(res: dict[str, Any]) -> str:
    per = res["seconds_per_run_round"]
    groups = res.get("runs_per_group", {})  # absent from the records of the serial engine
    return "\n".join(
        [
            "## 2. The same set one at a time and together (`python -m benchmarks.engine`)",
            "",
            f"Device: {res['device']}. Runs: {', '.join(res['runs'])} (one seed: they share micro-batches), "
            f"{res['rounds_per_run']} rounds each, 3 QMSum domain clients of 16 train and 6 valid examples, the real "
            f"MiniLM-L6 BERT2BERT backbone, float32; the prefix cache filled by a warm-up run first. Client rounds "
            f"trained per stacked group (pipeline.training.local_batch): alone {groups.get('alone')}, together "
            f"{groups.get('together')}. Alone and "
            f"together alternate {res['repeats']} time(s) in one process; the best of each is reported (the "
            "machine was shared with other jobs during the run, so both saw the same kind of load).",
            "",
            "| | seconds (set) | seconds per run-round | x floor |",
            "|---|---|---|---|",
            f"| one at a time | {res['seconds_alone']} | {per['alone']} | {per['alone'] / per['floor']:.1f} |",
            f"| together (one set) | {res['seconds_together']} | {per['together']} | "
            f"{per['together'] / per['floor']:.1f} |",
            f"| FLOP floor | {res['floor_seconds']} | {per['floor']} | 1 |",
            "",
            f"All wall times: alone {res['seconds_alone_all']}, together {res['seconds_together_all']}; this "
            f"process's CPU seconds (its threads' user + system time, less sensitive to the other jobs): alone "
            f"{res['cpu_seconds_alone_all']}, together {res['cpu_seconds_together_all']}. The floor: "
            "benchmarks/flops.py's matmul FLOPs of each round at the examples' real lengths "
            f"({', '.join(f'{n} {f / 1e12:.2f} TFLOP' for n, f in res['flops_per_run'].items())} over all rounds) at "
            f"the best fp32 matmul rate measured before each repeat ({res['matmul_peak_gflops']} GFLOP/s, `torch.mm`, "
            f"of {res['matmul_gflops_all']}; under load, so the floor is an upper bound of the idle machine's). "
            f"Together vs alone: largest adapter difference {res['max_abs_adapter_diff']:.1e}, best and stop rounds "
            f"{'identical' if res['same_rounds'] else 'DIFFERENT'}.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one two-path round and exit")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny BART instead of MiniLM (with --profile)")
    ap.add_argument("--dump", default=None, help="with --profile: write the cProfile stats file here")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="alone/together pairs, alternating which goes first")
    ap.add_argument(
        "--out", default="reports/bench", help="where engine.json goes and engine.md's section 2 is written"
    )
    ap.add_argument("--work", default=None, help="workspace directory (default: a temporary one)")
    ap.add_argument("--render", action="store_true", help="only rewrite engine.md's section 2 from engine.json")
    args = ap.parse_args(argv)
    if args.render:
        write_report(json.loads((Path(args.out) / "engine.json").read_text()), Path(args.out))
        return
    project = Path.cwd()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="engine-bench-"))
    params = build_workspace(work, str(project / "params.yaml"), tiny=args.tiny)
    os.chdir(work)
    os.environ["FEDMEET_ROOT"] = str(work)
    try:
        if args.profile:
            print(profile_round(work, params, dump=args.dump))
            return
        res = side_by_side(work, params, args.rounds, args.repeats)
    finally:
        os.chdir(project)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    write_report(res, Path(args.out))
    print(json.dumps(res, indent=1))


def write_report(res: dict[str, Any], out: Path) -> None:
    write_json(out / "engine.json", res)
    md = out / "engine.md"
    text = md.read_text() if md.exists() else "# The set engine (issue 53)\n"
    before, _, after = text.partition("## 2.")
    rest = after.partition("\n## 3.")[2]  # the sections after this one stay as they are
    md.write_text(before.rstrip() + "\n\n" + markdown(res) + ("\n## 3." + rest if rest else ""))


if __name__ == "__main__":
    main()
