"""The numbers the study READMEs quote by hand, against the committed files that back them: a number that drifts
from its file fails here. (The Results block of reports/cpu-study/README.md is generated: tests/test_claims.py.)"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import yaml

from pipeline.results.kd_analysis import SWEEP_POS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "reports/cpu-study"
README = (STUDY / "README.md").read_text(encoding="utf-8")
TEXT = " ".join(README.split())  # the prose with its line breaks as spaces


def load(name: str):
    return json.loads((STUDY / name).read_text())


def table_rows(heading: str) -> list[list[str]]:
    """The cells of the body rows of the first markdown table after ``heading``."""
    part = README.split(heading, 1)[1].split("\n\n")
    lines = next(p for p in part if p.lstrip().startswith("|")).strip().splitlines()[2:]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def span(values, fmt: str = "{:.0f}", unit: str = "") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def test_the_settings_quoted_are_the_studys_params_and_records():
    params = yaml.safe_load((STUDY / "params.yaml").read_text())
    train, model = params["train"], params["model"]
    assert f"{train['rounds']} rounds of {train['local_epochs']} local epoch" in TEXT
    assert f"batch {train['batch_size']} x {train['grad_accum_steps']} accumulation steps" in TEXT
    assert f"lr {train['lr']:.0e}".replace("e-0", "e-") in TEXT and f"weight decay {train['weight_decay']}" in TEXT
    assert f"lambda {train['kd_lambda']}" in TEXT and f"tau {params['tau']:g} nats" in TEXT
    assert f"top-{model['top_k']} decoder layers adapted (m = {model['bottleneck']})" in TEXT
    seeds = sorted({e["seed"] for e in params["experiments"].values()})
    assert f"training seeds {', '.join(map(str, seeds))}." in TEXT
    metrics = load("train/single-domain-s0/metrics.json")["clients"]
    assert "(" + ", ".join(f"{c} {v['n_train_examples']}" for c, v in metrics.items()) + " training examples)" in TEXT
    tests = load("eval/single-domain-s0/metrics.json")["clients"]
    assert "beam 4 on every test example (" + "/".join(str(v["n"]) for v in tests.values()) + ")" in TEXT
    assert all(v["n"] == v["n_test"] for v in tests.values())  # every test example
    assert f"giving the {len(params['experiments'])} plan files" in TEXT
    assert f"{sum(v['n'] for v in tests.values())} examples" in TEXT


def test_the_backbone_recipes_table_is_backbones_json():
    variants = load("backbones.json")["variants"]
    init = {"copy of the layer's self-attention": "self_attention", "random (HF default)": "random"}
    rows = table_rows("## The backbone")
    assert len(rows) == len(variants)
    for cells in rows:
        lr, new_lr = (float(x) for x in cells[1].split(" / "))
        specs = {n: dict(kv.split("=") for kv in v["spec"].split(":", 1)[1].split(",")) for n, v in variants.items()}
        match = [
            variants[n]
            for n, spec in specs.items()
            if spec["cross_attention_init"] == init[cells[0]]
            and float(spec["lr"]) == lr
            and float(spec["cross_attention_lr"]) == new_lr
        ]
        assert len(match) == 1, cells
        v = match[0]
        assert [c.strip("*") for c in cells[2:]] == [
            f"{v['rouge1']:.2f}",
            f"{v['rouge2']:.2f}",
            f"{v['rougeL']:.2f}",
            f"{v['final_loss']:.2f}",
        ]
    chosen = variants[load("backbones.json")["chosen"]]
    assert f"**{chosen['rouge1']:.2f}**" in TEXT and rows[0][2] == f"**{chosen['rouge1']:.2f}**"  # "the first"


def test_the_backbone_cost_and_warmup_are_its_records():
    backbone, times = load("backbone.json"), load("timing/device-study.json")
    warm, ev = backbone["warmup"], backbone["evaluation"]
    assert (
        f"Four warm-up recipes, {warm['steps']:,} steps of {warm['config']['batch_size']} SAMSum dialogues each "
        f"({warm['epochs']:.1f} epochs)"
    ) in TEXT
    assert f"validation split ({ev['examples']} dialogues)" in TEXT
    builds = [v for k, v in times.items() if k.startswith("backbone-")]
    assert (
        f"{warm['seconds']:.0f} s of warm-up on the H100 ({len(builds)} recipes side by side, {span(builds)} s" in TEXT
    )
    assert (
        f"{len(builds)} recipes side by side, {span(builds)} s each ({warm['seconds']:.0f} s warm-up + "
        f"{ev['seconds']:.0f} s scoring"
    ) in TEXT


def test_the_wall_times_are_the_timing_file():
    times = load("timing/device-study.json")

    def of(*prefixes: str) -> list[float]:
        return [v for k, v in times.items() if k.startswith(prefixes)]

    assert (
        f"AdaSingle, AdaCentralized and FedAvg {span(of('train-single', 'train-centralized', 'train-fedavg'))} s"
        in TEXT
    )
    assert f"FedKD and SelectKD (two model paths a round) {span(of('train-fedkd', 'train-fedselectkd'))} s" in TEXT
    trained, evaluated = of("train-"), of("evaluate-")
    assert f"evaluate stage (beam 4, 244 examples) {span(evaluated)} s" in TEXT
    assert f"Sum over the {len(trained)} runs" in TEXT and len(trained) == len(evaluated)
    assert f"train {sum(trained):,.0f} s, evaluate {sum(evaluated):,.0f} s" in TEXT
    # "FedAvg seeds 1 and 2 are not in it"
    assert not any("fedavg-domain-s1" in k or "fedavg-domain-s2" in k for k in times)


def test_the_kd_usage_table_is_the_kd_analysis():
    kd = load("analysis/kd_analysis.json")
    backbone = load("backbone.json")
    portable = {(p["tau_scale"], p["client"]): p for p in kd["tau_sweep"]["portable_gates"]}
    clients = list(kd["clients"])
    gates = {
        f"tau = {kd['tau']:g} nats (paper's value)": [kd["clients"][c] for c in clients],
        "tau = 0.46 ln\\|V\\| (= 4.75 nats here)": [portable[("max_entropy", c)] for c in clients],
        "0.87-quantile of each batch's H(q_g)": [portable[("batch_quantile", c)] for c in clients],
    }
    rows = {cells[0]: cells[1:] for cells in table_rows("## Why KD usage differs from the paper")}
    for gate, recs in gates.items():
        assert rows[gate] == [
            *(f"{100 * r['kd_usage_ratio']:.1f} %" for r in recs),
            span([100 * r["noun_verb_kd_rate"] for r in recs], unit=" %"),
            span([100 * r["det_pron_share_of_no_kd"] for r in recs], unit=" %"),
        ], gate
    # "at tau = 5 the two agree to 0.1 point": pooled (the clients' entries) against the seeds' mean (the sweep's point)
    at_tau = {p["client"]: p for p in kd["tau_sweep"]["points"] if p["tau"] == kd["tau"]}
    assert all(abs(kd["clients"][c][k] - at_tau[c][k]) < 0.001 for c in clients for k in SWEEP_POS)
    paper = rows["paper (BART-large)"]
    assert paper[:3] == [f"{100 * kd['paper']['kd_usage_ratio'][c]:.0f} %" for c in clients]
    assert paper[4] == f"{100 * kd['paper']['det_pron_share_of_no_kd']:.0f} %"
    # tau = 5 nats is 46 % of ln|V| on BART's vocabulary; the same share of MiniLM's is 4.75 nats
    assert round(kd["tau"] / math.log(50265), 2) == 0.46 and f"{0.46 * math.log(backbone['vocab_size']):.2f}" == "4.75"
    assert f"MiniLM's {backbone['vocab_size']:,} tokens" in TEXT
    drops = [
        100 * (kd["clients"][c]["kd_usage_ratio"] - portable[("max_entropy", c)]["kd_usage_ratio"]) for c in clients
    ]
    assert all(abs(d - 5) < 1 for d in drops)  # "usage drops by ~5 points"
    quantile = [100 * portable[("batch_quantile", c)]["kd_usage_ratio"] for c in clients]
    assert f"reproduces the paper's usage ({span(quantile)} %)" in TEXT
    det_pron = [100 * r["det_pron_share_of_no_kd"] for recs in gates.values() for r in recs]
    assert f"({span(det_pron)} % vs the paper's {100 * kd['paper']['det_pron_share_of_no_kd']:.0f} %)" in TEXT


def test_the_bench_readme_is_rendered_from_its_json_files():
    """reports/bench/README.md is benchmarks.readme's rendering of the JSON files beside it, number for number."""
    pytest.importorskip("torch")
    from benchmarks import readme
    from benchmarks.run import load_results

    bench = ROOT / "reports/bench"
    assert readme.render(load_results(bench)) == (bench / "README.md").read_text(encoding="utf-8")


def test_the_privacy_study_settings_quoted_are_its_params_and_records():
    """reports/privacy/README.md's study settings (examples, rounds, test examples, epsilons, delta, seeds, runs)."""
    study = ROOT / "reports/privacy/study"
    text = " ".join((ROOT / "reports/privacy/README.md").read_text(encoding="utf-8").split())
    params = yaml.safe_load((study / "params.yaml").read_text())
    runs = params["experiments"]
    metrics = [json.loads((study / "train" / name / "metrics.json").read_text()) for name in runs]
    eps = sorted({r["privacy"]["target_epsilon"] for r in runs.values() if "privacy" in r}, reverse=True)
    seeds = sorted({r["seed"] for r in runs.values()})
    n_clients = {len(m["clients"]) for m in metrics}
    per_client = params["evaluate"]["test_examples_per_client"]
    assert f"(tau {params['tau']:g} nats)" in text
    assert f"{params['train']['max_train_examples_per_client']} training examples per client" in text
    assert f"{params['train']['rounds']} rounds, greedy decoding" in text and params["evaluate"]["num_beams"] == 1
    assert f"{per_client} test examples per client" in text
    assert "at a target epsilon of " + ", ".join(map(str, eps[:-1])) + f" and {eps[-1]}" in text
    assert f"training seeds {', '.join(map(str, seeds[:-1]))} and {seeds[-1]}: {len(runs)} trainings" in text
    deltas = {c["privacy"]["delta"] for m in metrics for c in m["clients"].values() if c.get("privacy")}
    assert deltas == {1e-5} and "delta = 1e-5" in text
    assert len(n_clients) == 1 and f"ROUGE rests on {per_client * n_clients.pop()} test examples" in text
    assert f"a {params['train']['rounds']}-round budget" in text
    dp = json.loads((ROOT / "reports/privacy/client_dp.json").read_text())
    sizes = sorted({r["clients"] for r in dp["runs"]})
    assert (
        f"across {', '.join(map(str, sizes[:-1]))} and {sizes[-1]} clients, {dp['privacy']['sampling'].capitalize()}"
        in text
    )


def test_the_statistics_docs_query_and_meeting_counts_are_the_cpu_studys_test_set():
    """docs/statistics.md: "QMSum's 244 test queries come from 35 meetings (Academic 9, Committee 6, Product 20)"."""
    pd = pytest.importorskip("pandas")
    text = " ".join((ROOT / "docs/statistics.md").read_text(encoding="utf-8").split())
    scores = pd.read_parquet(STUDY / "eval/centralized-domain-s0/per_example.parquet")
    meeting = scores["example_id"].str.rsplit("/", n=1).str[0]  # pipeline.results.stats.meetings
    per_client = ", ".join(f"{c} {n}" for c, n in meeting.groupby(scores["client"]).nunique().items())
    assert f"QMSum's {len(scores)} test queries come from {meeting.nunique()} meetings ({per_client})" in text


def test_the_statistics_docs_expected_test_overlap_over_seeds_is_the_partitions():
    """docs/statistics.md: with 3 seeds a client keeps in common "244 / 27 = 9 of ~81 for an iid client, 129 (40 /
    129)³ = 4 of 40 for non-iid Product": the iid partition deals the 244 test queries to 3 clients, noniid_balanced
    draws 40 of Product's 129 (the committed partition reports and params.yaml)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())["partition"]
    text = " ".join((ROOT / "docs/statistics.md").read_text(encoding="utf-8").split())
    iid = json.loads((ROOT / "reports/partitions/iid-seed0.json").read_text())["clients"]
    tests = [c["sizes"]["test"] for c in iid.values()]
    k = params["iid"]["n_clients"]
    product = json.loads((ROOT / "reports/partitions/domain-seed0.json").read_text())["clients"]["Product"]["sizes"]
    drawn = params["noniid_balanced"]["sizes"]["test"]
    n, pool = sum(tests), product["test"]
    assert len(tests) == k == 3 and round(sum(tests) / k) == 81
    assert f"expected {n} / {k**3} = {n / k**3:.0f} of ~{round(n / k)} for an iid client" in text
    assert f"{pool} ({drawn} / {pool})³ = {pool * (drawn / pool) ** 3:.0f} of {drawn} for non-iid Product" in text


def test_the_statistics_docs_settings_are_params_and_the_committed_studies():
    """docs/statistics.md's settings: the claim rules and the identical-summary warning (params.yaml), the main
    study's client-average family (reports/tables/comparisons.csv), and the stop rule (configs/gpu-study.yaml) with
    the CPU study's curves it was chosen on (its train records: runs and fixed rounds)."""
    pd = pytest.importorskip("pandas")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stop = yaml.safe_load((ROOT / "configs/gpu-study.yaml").read_text())["train"]["stop"]
    text = " ".join((ROOT / "docs/statistics.md").read_text(encoding="utf-8").split())
    table = pd.read_csv(ROOT / "reports/tables/comparisons.csv")
    family = table[(table.study == "main") & (table.client == "client average") & (table.metric == "avg_rouge")]
    assert f"(the main study {len(family)} on the client average)" in text
    seeds = params["report"]["claim_min_seeds"]
    assert f"`report.claim_min_seeds` ({seeds};" in text and f"`report.claim_min_seeds: {seeds}`" in text
    assert f"fewer than {seeds} seeds states its numbers" in text
    assert f"`bootstrap.identical_warning` ({100 * params['bootstrap']['identical_warning']:.0f} %)" in text
    level, alpha = (
        100 * params["bootstrap"]["level"],
        1 - params["bootstrap"]["level"],
    )  # the claims' test: p_holm < 1 - level
    assert (
        f"{level:.0f} % percentile interval" in text
        and f"The intervals printed are the unadjusted {level:.0f} %" in text
    )
    assert (
        f"is `p_holm` < {alpha:.2g}, so the chance of any false claim in a family is at most {100 * alpha:.0f} %"
        in text
    )
    assert f"A claim is a Holm-adjusted p < {alpha:.2g}" in text
    runs = [json.loads(p.read_text()) for p in sorted((STUDY / "train").glob("*/metrics.json"))]
    rounds = yaml.safe_load((STUDY / "params.yaml").read_text())["train"]["rounds"]
    assert f"in each of the last {stop['patience']} rounds" in text and stop["enabled"]
    assert f"by less than {100 * stop['min_rel_improvement']:g} %, or at {stop['max_rounds']} rounds" in text
    assert f"CPU study's {len(runs)} committed curves ({rounds} fixed rounds each" in text
    # the GPU study's stop rounds under that rule, from its run records
    gpu = [json.loads(p.read_text()) for p in sorted((ROOT / "reports/gpu-study/runs").glob("*/metrics.json"))]
    stopped = sorted(r["stopped_round"] for r in gpu if r["converged"])
    assert yaml.safe_load((ROOT / "reports/gpu-study/params.yaml").read_text())["train"]["stop"] == stop
    assert (
        f"it ended all {len(gpu)} of its runs before the ceiling, at round {statistics.median(stopped):g} "
        f"({stopped[0]}-{stopped[-1]})" in text
    ) and len(stopped) == len(gpu)


def test_the_cpu_study_readmes_design_and_missing_run_are_its_files():
    """reports/cpu-study/README.md: the title's "five methods x 3 seeds ... plus two portable KD gates", "warmed up
    1,200 steps", the lent **NVIDIA H100 80GB** (backbones.json), the 4 recipe variants, and "FedAvg is therefore
    n = 2 (seeds 0 and 2)" (the evaluations present)."""
    params = yaml.safe_load((STUDY / "params.yaml").read_text())
    runs = params["experiments"].values()
    arms = {(r["method"], r.get("tau_scale")) for r in runs}
    gates = {a for a in arms if a[1] is not None}
    seeds = sorted({r["seed"] for r in runs})
    assert len(arms - gates) == 5 and len(gates) == 2 and len(runs) == len(arms) * len(seeds)
    assert f"five methods x {len(seeds)} seeds on the full QMSum domain partition, plus two portable KD gates" in TEXT
    assert f"warmed up {load('backbone.json')['warmup']['steps']:,} steps with cross-attention" in TEXT
    variants = load("backbones.json")
    assert f"on a lent **{variants['device'].removesuffix(' HBM3')}** (`backbones.json`)" in TEXT
    assert f"({len(variants['variants'])} variants) --parallel {len(variants['variants'])}`" in TEXT
    fedavg = sorted(int(p.name[-1]) for p in (STUDY / "eval").glob("fedavg-domain-s*"))
    assert fedavg == [0, 2] and "FedAvg is therefore n = 2 (seeds 0 and 2)" in TEXT
    assert (STUDY / "train/fedavg-domain-s1/metrics.json").exists()  # "It trained (its `train/` files are here)"


def test_the_privacy_studys_round_budget_count_is_its_train_records_and_its_table_is_the_rebuilt_one():
    """reports/privacy/README.md said "every client-run had its best validation round in its last", and the study's
    top-level study_privacy.md (the export of the experiment's table) counted "72 of 72"; the train records hold one
    client-run (fedselectkd-eps1-s0, Product: best round 2 of 3) that was not, as the rebuilt
    tables/study_privacy.md counts (71 of 72). The README's count is the records', and the table the docs name is
    the one `pipeline.report rebuild` writes."""
    study = ROOT / "reports/privacy/study"
    text = " ".join((ROOT / "reports/privacy/README.md").read_text(encoding="utf-8").split())
    last = []
    for path in sorted((study / "train").glob("*/metrics.json")):
        record = json.loads(path.read_text())
        final = record.get("stopped_round") or record["rounds"]
        last += [c["best_round"] == final for c in record["clients"].values()]
    assert f"{sum(last)} of the {len(last)} client-runs had their best validation round in their last" in text
    table = (study / "tables/study_privacy.md").read_text(encoding="utf-8")
    assert f"↗ {sum(last)} of {len(last)} client-runs had their best validation round in their last round" in table
    assert (study / "study_privacy.md").read_text(encoding="utf-8") == table
