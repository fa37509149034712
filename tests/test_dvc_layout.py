"""How the project sits in DVC: which files are metrics, the headline metrics file, params.yaml under `-S`, the
datasets as DVC imports, and the grid commands."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import yaml
from dvc.utils.hydra import apply_overrides

from pipeline.common.config import flatten
from pipeline.presets import REPLACED_WHOLE, hydra_value
from pipeline.results import comparisons
from pipeline.results.outputs import HEADLINE_STUDY, OTHER_OUTPUTS, average_interval, headline_metrics
from pipeline.results.stats import BootstrapConfig

ROOT = Path(__file__).resolve().parents[1]
DVC_YAML = yaml.safe_load((ROOT / "dvc.yaml").read_text())
# Keys of reports/metrics.json: the numbers a researcher compares across DVC experiments, nothing else.
HEADLINE_KEYS = {"rouge1", "rouge2", "rougeL", "avg_rouge", "avg_rouge_low", "avg_rouge_high", "clients"}


def _entries(section) -> list[tuple[str, dict]]:
    """(path, options) of a dvc.yaml outs/metrics/plots list."""
    out = []
    for item in section or []:
        if isinstance(item, str):
            out.append((item, {}))
        else:
            ((path, opts),) = item.items()
            out.append((path, opts or {}))
    return out


def _stage_sections(name: str) -> list[tuple[str, str, dict]]:
    """(stage, path, options) of every stage's ``name`` section (outs, metrics or plots; foreach bodies included)."""
    rows = []
    for stage, body in DVC_YAML["stages"].items():
        body = body.get("do", body)
        for section in ("outs", "metrics", "plots"):
            if section == name:
                rows += [(stage, path, opts) for path, opts in _entries(body.get(section))]
    return rows


# ------------------------------------------------------------------------------------------------ metrics
def test_the_metrics_are_the_headline_and_each_experiments_evaluation():
    metrics = {(stage, path): opts for stage, path, opts in _stage_sections("metrics")}
    assert list(metrics) == [("evaluate", "reports/eval/${key}/metrics.json"), ("report", "reports/metrics.json")]
    assert metrics[("report", "reports/metrics.json")].get("cache") is False  # small JSON kept in git
    assert "metrics" not in DVC_YAML  # no top-level metrics either


def test_every_experiment_of_the_default_profile_is_a_dvc_model_artifact():
    experiments = yaml.safe_load((ROOT / "params.yaml").read_text())["experiments"]
    artifacts = DVC_YAML["artifacts"]
    assert list(artifacts) == list(experiments)
    for name, artifact in artifacts.items():
        assert (artifact["path"], artifact["type"]) == (f"models/{name}", "model")
        assert artifact["labels"] == [experiments[name]["method"], experiments[name].get("study", "main")]


def test_no_time_or_memory_file_is_a_metric_and_the_former_metrics_stay_outputs():
    metric_paths = [path for _, path, _ in _stage_sections("metrics")]
    assert not [p for p in metric_paths if re.search(r"timing|time|memory|rss|bench", p)]
    # Every stage still declares its wall-time record and its report as plain outputs: kept in git (uncached)
    # by the cheap stages, in the DVC cache by the run-cached ones (next test).
    timed = {stage for stage, path, _ in _stage_sections("outs") if path.startswith("reports/timing/")}
    assert timed == set(DVC_YAML["stages"]) - {"plan"}  # every stage but plan (it writes no time record)
    former = {  # each former metric, an output of the stage that writes it
        "reports/summary.json": "report",
        "reports/analysis/kd_analysis.json": "analyze",
        "reports/backbone.json": "backbone",
        "reports/train/${key}/metrics.json": "train",
        "reports/partitions/${item.scheme}-seed${item.seed}.json": "partition",
        "reports/data/stats.json": "examples",
    }
    outs = _stage_sections("outs")
    assert {path: stage for stage, path, _ in outs if path in former} == former
    for stage, path, opts in outs:
        if path.startswith("reports/timing/") or path in former:
            assert (opts.get("cache") is False) == (stage not in RUN_CACHED), path


# The expensive stages, whose finished runs DVC's run cache must be able to restore (a rerun, a queued or --temp
# experiment, a preset run in parts: pipeline.presets.run_commands).
RUN_CACHED = ("backbone", "train", "evaluate")


@pytest.mark.parametrize("stage", RUN_CACHED)
def test_expensive_stages_can_be_restored_from_dvc_run_cache(stage):
    """DVC 3.67 saves a run-cache entry only when no output persists (dvc.stage.cache._can_hash) and every
    uncached output is a metric or a plot (dvc.stage.Stage.run: ``no_cache_outs``)."""
    body = DVC_YAML["stages"][stage].get("do", DVC_YAML["stages"][stage])
    outs = list(_entries(body.get("outs"))) + list(_entries(body.get("metrics")))
    assert outs and body.get("cmd") and body.get("deps")
    for path, opts in outs:
        assert not opts.get("persist"), path
        assert opts.get("cache", True), f"{stage}: uncached output {path} disables DVC's run cache"


def _agg_row(label, client, r1, r2, rl, study="main"):
    return {
        "study": study,
        "label": label,
        "method": label.split()[0],
        "client": client,
        "rouge1_mean": r1,
        "rouge2_mean": r2,
        "rougeL_mean": rl,
        "avg_rouge_mean": (r1 + r2 + rl) / 3,
    }


def test_headline_metrics_from_hand_made_results():
    agg = pd.DataFrame(
        [
            _agg_row("fedavg", "A", 30.0, 6.0, 24.0),
            _agg_row("fedavg", "B", 20.0, 4.0, 18.0),
            _agg_row("fedselectkd tau=5", "A", 33.0, 9.0, 27.0),
            _agg_row("fedselectkd tau=5", "B", 21.0, 3.0, 18.0),
            _agg_row("fedavg", "A", 99.0, 99.0, 99.0, study="iid"),  # another study: never a headline number
        ]
    )
    kd = {"clients": {"B": {"kd_usage_ratio": 0.4}, "A": {"kd_usage_ratio": 0.2}, "C": {"kd_usage_ratio": None}}}
    out = headline_metrics(agg, {"fedselectkd tau=5": (15.0, 20.5), "fedavg": None}, kd)
    assert set(out) == {HEADLINE_STUDY, "kd_usage"}
    fsk = out["main"]["fedselectkd"]  # by method: `-S tau=4` keeps the same metric column
    assert fsk["rouge1"] == 27.0 and fsk["rouge2"] == 6.0 and fsk["rougeL"] == 22.5
    assert fsk["avg_rouge"] == pytest.approx((23.0 + 14.0) / 2, abs=1e-4)
    assert (fsk["avg_rouge_low"], fsk["avg_rouge_high"]) == (15.0, 20.5)
    assert fsk["clients"] == {"A": 23.0, "B": 14.0}
    assert "avg_rouge_low" not in out["main"]["fedavg"]  # no per-example scores: no interval, never a made-up one
    assert out["main"]["fedavg"]["clients"] == {"A": 20.0, "B": 14.0}
    assert out["kd_usage"] == {"A": 0.2, "B": 0.4, "mean": 0.3}
    for entry in out["main"].values():
        assert set(entry) <= HEADLINE_KEYS
    assert headline_metrics(agg.iloc[0:0], {}, {}) == {}
    # two configurations of one method in the study: each keeps its own label
    two = pd.concat([agg, pd.DataFrame([_agg_row("fedselectkd tau=3", "A", 30.0, 6.0, 24.0)])])
    assert {"fedselectkd_tau=5", "fedselectkd_tau=3", "fedavg"} == set(headline_metrics(two, {}, {})["main"])


def _per_example(eval_dir: Path, name: str, scores: dict[str, list[float]]) -> None:
    rows = [
        {"client": c, "example_id": f"{c}{i}", "rouge1": v, "rouge2": v, "rougeL": v, "rougeLsum": v, "avg_rouge": v}
        for c, vals in scores.items()
        for i, v in enumerate(vals)
    ]
    (eval_dir / name).mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(eval_dir / name / "per_example.parquet")


def test_average_interval_of_a_configuration(tmp_path):
    cfg = BootstrapConfig(n_resamples=500, seed=3)
    # Constant scores within each client: every resample gives the same client average, (10 + 20) / 2.
    _per_example(tmp_path, "flat", {"A": [10.0] * 4, "B": [20.0] * 6})
    flat = comparisons.Config("main", "x", "fedavg", "domain", ((0, "flat"),))
    assert average_interval(flat, tmp_path, cfg) == pytest.approx((15.0, 15.0))
    # Two seeds: client averages 7.5 and 9.5 (seed variance 2 / 2 = 1), seed-averaged examples A 1, 11, 21 and
    # B 6, 6 (example variance (100 / 3 + 0) / 4), no seed x example residual; t with Welch-Satterthwaite's df.
    _per_example(tmp_path, "s0", {"A": [0.0, 10.0, 20.0], "B": [5.0, 5.0]})
    _per_example(tmp_path, "s1", {"A": [2.0, 12.0, 22.0], "B": [7.0, 7.0]})
    two = comparisons.Config("main", "y", "fedavg", "domain", ((0, "s0"), (1, "s1")))
    low, high = average_interval(two, tmp_path, cfg)
    var = 1.0 + 25.0 / 3.0
    half = scipy.stats.t.ppf(0.975, var**2 / (1.0 + (25.0 / 3.0) ** 2 / 3)) * var**0.5
    assert (low, high) == pytest.approx((8.5 - half, 8.5 + half))
    assert average_interval(two, tmp_path, cfg) == (low, high)  # the bootstrap seed fixes it
    missing = comparisons.Config("main", "z", "fedavg", "domain", ((0, "never-evaluated"),))
    assert average_interval(missing, tmp_path, cfg) is None
    # a client of one test example has no spread to give: no interval, not B's alone (as one seed drew before)
    _per_example(tmp_path, "one", {"A": [10.0], "B": [20.0, 30.0, 50.0]})
    one = comparisons.Config("main", "w", "fedavg", "domain", ((0, "one"),))
    assert average_interval(one, tmp_path, cfg) is None


def test_average_interval_of_seeds_that_redraw_the_test_sets(tmp_path):
    """Each seed its own test examples (iid/seed{k}): every seed's full test sets, not the one example A's three
    seeds share. Seed client averages D_s; estimate mean D_s, variance max(var(D_s) / 3, sum_s v_s / 9) with v_s =
    (var(A) / n_A + var(B) / n_B) / 4 (ddof 1), Welch-Satterthwaite df against 2 and the examples' 15 - 6."""
    cfg = BootstrapConfig(n_resamples=500, seed=3)
    seeds = [
        {"A": [1.0, 4.0, 8.0], "B": [5.0, 6.0]},
        {"A": [3.0, 2.0, 9.0, 5.0], "B": [8.0, 7.0]},
        {"A": [0.0, 6.0], "B": [4.0, 9.0]},
    ]
    for k, scores in enumerate(seeds):
        _per_example(tmp_path, f"r{k}", scores)  # ids A0, A1, ...: only A0 (and B0, B1) in every seed
        frame = pd.read_parquet(tmp_path / f"r{k}" / "per_example.parquet")
        frame["example_id"] = [i if i in ("A0",) else f"s{k}-{i}" for i in frame["example_id"]]
        frame.to_parquet(tmp_path / f"r{k}" / "per_example.parquet")
    config = comparisons.Config("main", "x", "fedavg", "iid", tuple((k, f"r{k}") for k in range(3)))
    d = np.array([np.mean([np.mean(v) for v in s.values()]) for s in seeds])
    v_seed = d.var(ddof=1) / 3
    v_ex = sum(sum(np.var(v, ddof=1) / len(v) for v in s.values()) / 4 for s in seeds) / 9
    var = max(v_seed, v_ex)
    half = scipy.stats.t.ppf(0.975, var**2 / (v_seed**2 / 2 + v_ex**2 / (15 - 6))) * var**0.5
    assert average_interval(config, tmp_path, cfg) == pytest.approx((d.mean() - half, d.mean() + half))
    # a client one seed lacks: no client average to give
    frame = pd.read_parquet(tmp_path / "r2" / "per_example.parquet")
    frame[frame["client"] == "A"].to_parquet(tmp_path / "r2" / "per_example.parquet")
    assert average_interval(config, tmp_path, cfg) is None


# ------------------------------------------------------------------------------------------------ params.yaml
def _changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0, lineterm="")
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


@pytest.mark.parametrize(
    "override, line",
    [
        ("tau=4", "tau: 4"),
        ("train.rounds=5", "  rounds: 5"),
        ("experiments.tau-3.tau=2.0", "    tau: 2.0"),
        ("evaluate.num_beams=4", "  num_beams: 4"),
    ],
)
def test_dvc_set_param_changes_exactly_one_line(tmp_path, override, line):
    """`dvc exp run -S key=value` rewrites params.yaml with DVC's own writer (dvc.utils.hydra.apply_overrides):
    params.yaml is laid out as that writer keeps it, so the only change is the overridden key's line."""
    before = (ROOT / "params.yaml").read_text()
    target = tmp_path / "params.yaml"
    target.write_text(before)
    apply_overrides(str(target), [override])
    changed = _changed_lines(before, target.read_text())
    assert len(changed) == 2 and changed[0].startswith("-") and changed[1] == "+" + line


def test_params_yaml_is_a_fixed_point_of_dvcs_writer(tmp_path):
    """Setting keys to their own values leaves params.yaml byte for byte as it was, comments and blank lines
    included. DVC's writer replaces every list it is given, and with it any comment right after the list: each
    list is set here, so such a comment fails the test."""
    before = (ROOT / "params.yaml").read_text()
    lists = {k: v for k, v in flatten(yaml.safe_load(before), whole=REPLACED_WHOLE).items() if isinstance(v, list)}
    assert {"ingest.datasets", "partition.schemes", "report.baselines"} <= set(lists)
    target = tmp_path / "params.yaml"
    target.write_text(before)
    apply_overrides(str(target), ["tau=5.0", *(f"{k}={hydra_value(v)}" for k, v in lists.items())])
    assert target.read_text() == before
    assert yaml.safe_load(before)["tau"] == 5.0 and isinstance(yaml.safe_load(before)["tau"], float)


# ------------------------------------------------------------------------------------------------ datasets
def test_every_dataset_is_a_frozen_dvc_import_that_ingest_depends_on():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    ingest = DVC_YAML["stages"]["ingest"]["do"]
    root = params["ingest"]["data_root"]
    assert root == "data/raw" and "${ingest.data_root}/${item}" in ingest["deps"]
    for dataset in params["ingest"]["datasets"]:
        stage = yaml.safe_load((ROOT / f"data/raw/{dataset}.dvc").read_text())
        # frozen: workspaces check the import out of the cache instead of reading its source path, which DVC
        # would resolve against a temporary workspace under .dvc/tmp/exps/
        assert stage["frozen"] is True
        assert [o["path"] for o in stage["outs"]] == [dataset]
        assert stage["deps"][0]["path"] == f"../../../shared/data/{dataset}"
        assert stage["deps"][0]["md5"] == stage["outs"][0]["md5"]


def test_default_dvc_remote_is_configured():
    config = (ROOT / ".dvc/config").read_text()
    remote = re.search(r"remote\s*=\s*(\S+)", config)
    assert remote, ".dvc/config has no default remote"
    assert re.search(rf"\['remote \"{re.escape(remote.group(1))}\"'\]\s+url\s*=\s*\S+", config)


def _make_variable(makefile: str, name: str) -> str:
    return re.search(rf"^{name}\s*\?=\s*(.*)$", makefile, re.M).group(1).strip()


def test_make_grid_is_dvcs_own_sweep_of_tau_and_seed_over_every_experiment(tmp_path):
    """The grid's overrides, split into points by DVC's own sweep (what `dvc exp run --queue -S ...` queues) and
    applied by its writer: one point per (tau, seed), each giving every experiment that seed and every
    selective-KD experiment without its own tau that tau."""
    from dvc.utils.hydra import get_hydra_sweeps

    from pipeline.experiments.methods import get_method
    from pipeline.planning import declared

    makefile = (ROOT / "Makefile").read_text()
    taus, seeds = _make_variable(makefile, "GRID_TAUS"), _make_variable(makefile, "GRID_SEEDS")
    assert (taus, seeds) == ("2,3,4,5", "0,1,2")
    params_file = str(ROOT / "params.yaml")
    points = get_hydra_sweeps({params_file: [f"tau={taus}", f"seed={seeds}"]})
    assert len(points) == 12
    seen = set()
    for point in points:
        target = tmp_path / "params.yaml"
        target.write_text((ROOT / "params.yaml").read_text())
        apply_overrides(str(target), point[params_file])
        params = yaml.safe_load(target.read_text())
        planned = declared(params)
        assert len({e.seed for e in planned}) == 1  # every experiment at the point's seed
        own_tau = {n for n, e in params["experiments"].items() if "tau" in e}
        assert {e.tau for e in planned if get_method(e.method).uses_tau and e.name not in own_tau} == {params["tau"]}
        seen.add((params["tau"], planned[0].seed))
    assert seen == {(t, s) for t in (2, 3, 4, 5) for s in (0, 1, 2)}


def test_make_grid_and_exp_show_use_the_queue_and_the_headline_columns():
    makefile = (ROOT / "Makefile").read_text()
    grid = re.search(r"^grid:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "dvc exp run --queue -S 'tau=$(GRID_TAUS)' -S 'seed=$(GRID_SEEDS)'" in grid
    assert "dvc queue start -j $(JOBS)" in grid
    show = re.search(r"^exp-show:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "dvc exp show" in show and "--keep" in show


def _pipeline_imports(module: str) -> set[str]:
    """pipeline.* modules ``module`` imports anywhere (function-level imports included), read from its source."""
    import ast

    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from pipeline.modeling import model` imports a module; `from pipeline.modeling.model import X` a name
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("pipeline.") and (ROOT / (n.replace(".", "/") + ".py")).exists()}


def import_closure(module: str) -> set[str]:
    """The files of the pipeline modules ``module`` imports, directly or not (itself included)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(_pipeline_imports(current))
    return {m.replace(".", "/") + ".py" for m in seen}


# Strategy and KD gate modules: the plan of an experiment carries the source hash of the ones it runs
# (extension_md5, by pipeline.planning.resolve_plan), so the stages that read a plan do not depend on them and an
# edit of a module no experiment runs reruns nothing.
EXTENSION_DIRS = ("pipeline/federation/strategies", "pipeline/modeling/gates")
PLAN_READERS = ("pipeline.train", "pipeline.evaluate")


def extension_modules() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for d in EXTENSION_DIRS
        for p in (ROOT / d).glob("*.py")
        if p.stem not in ("__init__", "catalog", "registry")
    }


def expand(dep: str) -> set[str]:
    """The module files a pipeline/ dep stands for: itself, or every module under a folder."""
    path = ROOT / dep
    if path.is_dir():
        return {str(p.relative_to(ROOT)) for p in path.rglob("*.py") if p.name != "__init__.py"}
    return {dep}


def expected_module_deps(module: str) -> list[str]:
    """The pipeline/ deps of the stage running ``module``: its import closure (less the extension modules when it
    reads a plan), each package whose modules it all reads named as one folder; its own module first."""
    needed = import_closure(module) - (extension_modules() if module in PLAN_READERS else set())
    folders = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "pipeline").rglob("*")
        if p.is_dir() and p.name != "__pycache__" and set() < expand(str(p.relative_to(ROOT))) <= needed
    }
    folders = {f for f in folders if not any(f.startswith(g + "/") for g in folders)}
    files = {m for m in needed if not any(m.startswith(f + "/") for f in folders)}
    own = module.replace(".", "/") + ".py"
    return [own, *sorted((files | folders) - {own})]


def test_every_stage_depends_on_exactly_the_pipeline_modules_it_imports():
    # A module a stage reads but does not declare is a change DVC never reruns for (e.g. int8 transfer in
    # compression.py changes training results); one declared but not read reruns the stage for nothing.
    for stage, body in DVC_YAML["stages"].items():
        body = body.get("do", body)
        command = re.search(r"python -m (pipeline\.\w+)", body["cmd"])
        if command is None:
            continue
        declared = [d for d in body.get("deps", []) if isinstance(d, str) and d.startswith("pipeline/")]
        assert declared == expected_module_deps(command.group(1)), stage


@pytest.mark.parametrize("dataset", ["samsum", "ami"])
def test_the_backbone_stage_depends_on_the_records_its_warm_up_reads(dataset):
    # pipeline.modeling.backbone.resolve warms up and scores on <interim_dir>/<backbone.warmup.dataset>.parquet; the
    # deps as DVC interpolates them from params (ami: a long_meeting study without qmsum, which the stage allows)
    from dvc.parsing.context import Context

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["backbone"]["warmup"]["dataset"] = dataset
    deps = {Context(params).resolve_str(d) for d in DVC_YAML["stages"]["backbone"]["deps"]}
    assert f"data/interim/{dataset}.parquet" in deps


def test_a_folder_dep_hashes_no_bytecode():
    # DVC hashes every file of a folder dep: a __pycache__ written by any import would rerun the stage
    assert "__pycache__/" in (ROOT / ".dvcignore").read_text().splitlines()


def test_every_other_stage_output_the_report_index_lists_is_a_dep_of_the_report_stage():
    # reports/README.md lists what the outputs.OTHER_OUTPUTS globs find: one outside the report stage's deps (a
    # partition added, the report not rerun) is a change DVC never reruns the index for, so the index goes stale
    deps = DVC_YAML["stages"]["report"]["deps"]
    outside = [
        p for p in OTHER_OUTPUTS if not any(f"reports/{p}" == d or f"reports/{p}".startswith(d + "/") for d in deps)
    ]
    assert outside == []


def test_the_experiments_docs_metrics_files_and_exp_show_columns_are_what_a_repro_workspace_gives():
    """docs/experiments.md "Comparing experiments": the DVC metrics files are dvc.yaml's (the headline file and each
    evaluation's), and its column counts are those `dvc exp show` prints in a workspace `make repro` filled: DVC
    shows every param (params.yaml's leaves), every dependency's hash (dvc.lock's paths) and every key of every
    metrics file (reports/metrics.json, and one evaluation metrics.json per experiment, its keys a committed
    evaluation's), a file's key named `<path>:<key>`; `make exp-show` keeps the columns its regex matches from
    the start (measured 2026-11-27: 101 and 1,844 columns)."""
    import json

    doc = " ".join((ROOT / "docs/experiments.md").read_text(encoding="utf-8").split())
    section = doc.split("**Comparing experiments.**", 1)[1].split("- **Settings", 1)[0]
    paths = [path.replace("${key}", "<exp>") for _, path, _ in _stage_sections("metrics")]
    assert all(f"`{p}`" in section for p in paths), paths
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    deps = {d["path"] for s in yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"].values() for d in s["deps"]}
    evaluation = flatten(json.loads((ROOT / "reports/cpu-study/eval/single-domain-s0/metrics.json").read_text()))
    headline = flatten(json.loads((ROOT / "reports/metrics.json").read_text()))
    metrics = [*headline, *(f"reports/eval/{e}/metrics.json:{k}" for e in params["experiments"] for k in evaluation)]
    keep = _make_variable(
        (ROOT / "Makefile").read_text().replace("EXP_SHOW_KEEP :=", "EXP_SHOW_KEEP ?="), "EXP_SHOW_KEEP"
    )
    keep = keep.replace("$$", "$")
    named = ["Experiment", "Created", "State", "Executor", *metrics, "tau", "params.yaml:seed"]
    kept = [c for c in named if re.match(keep, c)]

    def stated(pattern: str) -> int:
        return int(re.search(pattern, section)[1].replace(",", ""))

    for got, pattern in [
        (len(kept), r"\(~([\d,]+) columns\)"),
        (len(flatten(params)), r"every parameter \(~([\d,]+) columns\)"),
        (len(deps), r"every dependency's hash \(~([\d,]+)\)"),
        (len(metrics), r"every evaluation's metrics \(~([\d,]+)\)"),
    ]:
        assert abs(stated(pattern) - got) <= 0.1 * got, (pattern, got)
    comment = " ".join(
        line.lstrip("# ") for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("#")
    )
    both = int(re.search(r"every param and dependency hash \(~([\d,]+) columns\)", comment)[1].replace(",", ""))
    assert abs(both - len(flatten(params)) - len(deps)) <= 0.1 * (len(flatten(params)) + len(deps))
    assert abs(
        int(re.search(r"every evaluation's metrics \(~([\d,]+);", comment)[1].replace(",", "")) - len(metrics)
    ) <= (0.1 * len(metrics))


def test_the_architecture_docs_path_table_names_every_dvc_metrics_file():
    """docs/ARCHITECTURE.md's paths table called reports/metrics.json "the only DVC metrics" and every other report
    file an uncached output, while dvc.yaml declares each evaluation's metrics.json a (cached) metric too."""
    text = (ROOT / "docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| DVC metrics |"))
    metrics = {path: opts for _, path, opts in _stage_sections("metrics")}
    for path, opts in metrics.items():
        cached = " (cached" in row.split(f"`{path.replace('${key}', '<experiment>')}`", 1)[1].split(".", 1)[0]
        assert cached == opts.get("cache", True), path
    assert "only DVC metrics" not in text


def test_the_experiments_docs_method_list_is_the_registry():
    """docs/experiments.md "Methods (`experiments.<name>.method`): ..." lists every method the plan stage accepts
    (pipeline.experiments.methods.METHODS); it left out fedtrimmedavg (11 of 12)."""
    from pipeline.experiments.methods import METHODS

    text = " ".join((ROOT / "docs/experiments.md").read_text(encoding="utf-8").split())
    listed = text.split("Methods (`experiments.<name>.method`): ", 1)[1].split(".", 1)[0]
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(METHODS)
