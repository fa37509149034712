"""Why selective KD works, over the declared experiments (stage ``analyze``: pipeline/analyze.py; METHOD.md section 7
items 6, 9, 10; what it computes: docs/experiments.md, where it writes: docs/ARCHITECTURE.md); the computations are
pipeline/results/kd_analysis.py.

The **KD usage ratio** of a main-study SelectKD client = KD word updates / word updates over rounds 1 .. its best
round. A *word update* is one target word (sub-word tokens mapped to whitespace words: modeling.target_tags, via
``data/processed/postags.parquet``) trained in one round, a KD word update when KD was applied to its tokens under
``analyze.word_rule`` (default ``first``: the word's first sub-word token, where the model chooses the word). The
teacher is fixed within a round, so a token trained in several local epochs counts once (KD if applied in any). The
paper's example: "project manager decides to use lcd", 2 rounds, 3 KD word updates -> 3 / (6 x 2) = 25 %.

Missing input files of listed experiments are reported in the JSON (``missing``), never replaced by numbers; a
main-study client's POS numbers and gate statistics pool its seeds' updates; other numbers over seeds are means.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from pipeline.common import atomic
from pipeline.common.config import ConfigError, config
from pipeline.common.schema import DataError, read_parquet
from pipeline.experiments.entries import TAU_STUDY, Experiment
from pipeline.experiments.train_config import UNITS
from pipeline.paths import ProjectPaths
from pipeline.results import kd_analysis
from pipeline.results.kd_analysis import HARDKD, SELECTKD
from pipeline.results.plotting import slug
from pipeline.results.published import KD_USAGE_RATIO
from pipeline.results.readers import best_rounds, read_eval_metrics, read_gate_log


@config
class AnalyzeConfig:
    word_rule: Literal[kd_analysis.WORD_RULES] = "first"  # type: ignore[valid-type]


class Analysis:
    def __init__(self, cfg: AnalyzeConfig, experiments: list[Experiment], paths: ProjectPaths, file: str):
        self.cfg, self.experiments, self.paths, self.file = cfg, experiments, paths, file  # file: the params read
        self.figures = paths.analysis / "figures"
        # (experiment, file) -> what needs it: inputs of listed experiments that do not exist (yet), reported in
        # kd_analysis.json, never replaced by numbers
        self.missing: dict[tuple[str, str], list[str]] = {}
        self.main = [e for e in experiments if e.method == SELECTKD and e.study == "main"]

    @functools.cached_property
    def postags(self) -> pd.DataFrame:
        if not self.paths.postags.exists():
            raise FileNotFoundError(f"{self.paths.postags}: POS tags not found (run `dvc repro postag`)")
        return read_parquet(self.paths.postags, "POS-tag table").astype({"example_id": str})

    def _present(self, exp: Experiment, needed_for: str, *paths: Path) -> bool:
        """Whether every input file is there; each absent one is reported as missing."""
        for p in paths:
            if not p.exists() and needed_for not in (uses := self.missing.setdefault((exp.name, str(p)), [])):
                uses.append(needed_for)
        return all(p.exists() for p in paths)

    def usage(self, exp: Experiment, needed_for: str) -> dict[str, Any] | None:
        """Word updates + per client best round and KD usage ratio of one experiment, or None if files are missing."""
        gate_path, train_path = self.paths.gate_log(exp.name), self.paths.train_metrics(exp.name)
        if not self._present(exp, needed_for, gate_path, train_path):
            return None
        gate = read_gate_log(gate_path)
        wu = kd_analysis.word_updates(gate, self.postags, self.cfg.word_rule, str(gate_path), str(self.paths.postags))
        best, clients = best_rounds(train_path), {}  # per client: its best round and KD usage ratio over 1..best
        for client, words in wu.groupby("client"):
            if client not in best:
                raise DataError(f"{train_path}: no best round for client {client!r} of {gate_path}")
            clients[client] = kd_analysis.kd_usage(words, best[client])
        return {"gate": gate, "words": wu, "clients": clients}

    def scores(self, exp: Experiment, needed_for: str) -> dict[str, dict[str, float]] | None:
        path = self.paths.eval_metrics(exp.name)
        if not self._present(exp, needed_for, path):
            return None
        if not (scores := read_eval_metrics(path)[1]):  # per client ROUGE, the tables' metrics
            raise DataError(f"{path}: no client has ROUGE scores")
        return scores

    def main_study(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]], float | None, str | None]:
        """Usage ratio, POS distribution and gate statistics per client; also returns per-experiment usage and the
        runs' tau and its unit, nats or bits (None: none, or not an entropy threshold)."""
        # a client's runs are pooled, here and in hardkd's seed means: one tau, gate and unit of H(q_g) (5 bits is
        # 5 ln 2 = 3.47 nats), checked over the params' runs, whether their logs exist or not
        setups = sorted({(e.tau, kd_analysis.gate_name(e), UNITS[e.entropy_log_base]) for e in self.main})
        if len(setups) > 1:
            raise ConfigError(f"{self.file}: the main-study SelectKD runs use different taus, gates or units: {setups}")
        usages = {e.name: u for e in self.main if (u := self.usage(e, "KD usage / POS analysis")) is not None}
        clients: dict[str, Any] = {}
        if not usages:
            return clients, usages, None, None
        all_words = pd.concat([u["words"].assign(experiment=n) for n, u in usages.items()])
        all_gate = pd.concat([u["gate"].assign(experiment=n) for n, u in usages.items()])
        # a portable gate's tau (a share of ln|V|, a quantile) or a margin is no entropy: no H(q_g) < tau, no tau line
        tau, kind, unit = setups[0]  # unit: H(q_g)'s, an absolute tau's too
        tau = tau if kind == "absolute" else None
        for client in sorted(all_words["client"].unique()):
            per_seed = {n: u["clients"][client] for n, u in usages.items() if client in u["clients"]}
            rec, gate = kd_analysis.client_summary(client, all_words, all_gate, per_seed, tau)
            clients[client] = rec
            kd_analysis.plot_pos(client, rec, self.figures / f"pos_{slug(client)}.png")
            kd_analysis.plot_entropy(client, gate, rec, tau, unit, self.figures / f"entropy_{slug(client)}.png")
        return clients, usages, tau, unit if tau is not None else None

    def hardkd(self) -> dict[str, Any]:
        """ROUGE of noun-verb hard KD vs SelectKD (main study) per client, mean and std over seeds, and their difference
        over the runs (partition, seed) both evaluated: equal footing, no seed's luck on one side."""
        main_parts = {e.partition for e in self.main}
        hard = [e for e in self.experiments if e.method == HARDKD and (not main_parts or e.partition in main_parts)]
        runs = {
            m: [(e, self.scores(e, "hard KD vs SelectKD")) for e in exps]
            for m, exps in ((SELECTKD, self.main), (HARDKD, hard))
        }
        comparison = {m: kd_analysis.seed_means([(e.name, s) for e, s in r]) for m, r in runs.items()}
        kd_analysis.plot_hardkd(comparison, self.figures / "hardkd_vs_selectkd.png")
        # the runs both evaluated: a planned run without scores (reported missing) would leave its seed on one side
        both = set.intersection(*({(e.partition, e.seed) for e, s in r if s is not None} for r in runs.values()))
        hard, select = (
            kd_analysis.seed_means([(e.name, s) for e, s in runs[m] if (e.partition, e.seed) in both])
            for m in (HARDKD, SELECTKD)
        )
        diff = {c: hard[c]["mean"]["avg_rouge"] - select[c]["mean"]["avg_rouge"] for c in hard if c in select}
        return {"methods": comparison, "hardkd_minus_selectkd_avg_rouge": diff}

    def tau_sweep(self, usages: dict[str, dict[str, Any]]) -> dict[str, Any]:
        sweep = [e for e in self.experiments if e.study == TAU_STUDY]
        # The main SelectKD joins the sweep (on its schemes) at its runs' tau: an entry's own, else the top-level.
        rows = []
        for e in sweep + [e for e in self.main if e.scheme in {s.scheme for s in sweep}]:
            usage = usages.get(e.name) or self.usage(e, "tau sweep")
            scores = self.scores(e, "tau sweep")
            if usage is not None and scores is not None:
                rows += kd_analysis.tau_sweep_rows(e, usage, scores)
        per_run = pd.DataFrame(rows, columns=kd_analysis.SWEEP_COLUMNS)
        table, portable = kd_analysis.tau_sweep_summary(per_run)
        atomic.to_csv(table.round(6), self.paths.analysis / "tau_sweep.csv", index=False)
        main = [kd_analysis.tau_nats(e) for e in self.main if kd_analysis.gate_name(e) == "absolute"]  # in nats too
        kd_analysis.plot_tau_sweep(table, main[0] if main else None, self.figures / "tau_sweep.png")
        return {
            "points": table.to_dict(orient="records"),
            "portable_gates": portable.to_dict(orient="records"),
            "experiments": sorted(per_run["experiment"].unique()),
        }

    def run(self) -> dict[str, Any]:
        self.figures.mkdir(parents=True, exist_ok=True)
        for old in self.figures.glob("*.png"):  # the stage owns this directory: no stale figures of removed clients
            old.unlink()
        clients, usages, tau, unit = self.main_study()
        hardkd, sweep = self.hardkd(), self.tau_sweep(usages)
        missing = [
            {"experiment": e, "file": f, "needed_for": ", ".join(u)} for (e, f), u in sorted(self.missing.items())
        ]
        result = kd_analysis.json_safe(
            {
                "word_rule": self.cfg.word_rule,
                "tau": tau,  # the main study's SelectKD runs', whose KD usage "clients" holds
                "tau_unit": unit,  # nats or bits (train.entropy_log_base)
                "paper": {
                    "kd_usage_ratio": KD_USAGE_RATIO,
                    "det_pron_share_of_no_kd": kd_analysis.PAPER_DET_PRON_SHARE_OF_NON_KD,
                    "noun_verb": "nearly all noun and verb words are trained with KD",
                },
                "clients": clients,
                "hardkd_vs_selectkd": hardkd,
                "tau_sweep": sweep,
                "missing": missing,
                "n_missing": len(missing),
            }
        )
        atomic.write_json(self.paths.kd_analysis, result)
        return result
