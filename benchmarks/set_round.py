"""The host time of a set round (issue 53/54 follow-up): where the GPU study's set spends a round outside its stacked
training and validation calls, on this CPU.

    python -m benchmarks.set_round --label after --repeats 2    # -> reports/bench/set_round.json's record "after"
    python -m benchmarks.set_round --compare before after       # the two records side by side, as ratios

The set is the GPU study's: configs/gpu-study.yaml's 30 runs (6 arms x 5 seeds, the three QMSum domain clients),
the tests' tiny BART (tests/tiny_models.py) with its adapter bottleneck widened so a client's adapter has the study's
size (MiniLM's d 384 x m 768 = the tiny d 32 x m 9216: 4.7 MB a message), the clients capped at ``--train`` and
``--valid`` examples (the caps change the arithmetic, not the per-run host work). It trains as the train stage
trains a set (``run_set``), as sets of 1 and of ``--rounds`` fixed rounds: their difference over the rounds after
the first is a steady round (the first fills the caches: prefix, tokens, plans). In it, (a) the wall seconds inside
the stacked calls at the barrier (``local_batch.train_jobs``, ``validate_jobs``: the arithmetic, not the target
here) and (b) the rest, the host time between two barriers: the least of ``--repeats`` timed pairs, the machine being
shared. Then both sets once more with every thread (each run's, each delivery's, the coordinator's) under a cProfile
of its own CPU time: CPU seconds a steady round by function, and (b)'s CPU seconds (all threads' less the stacked
calls'). A record is the code of the tree it runs in: "before" ran in a checkout of the base commit with this file
copied in.
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
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_json
from benchmarks.gpu_profile import REPO

STUDY_ADAPTER = (384, 768)  # the study's MiniLM d_model and bottleneck m (params.yaml model.bottleneck)
TOP = 25


class _Clock:
    """Wall seconds inside the stacked calls at the barrier, and the profiles of every thread of the set."""

    def __init__(self):
        self.stacked = 0.0
        self.profiles: list[cProfile.Profile] = []
        self.profiling = False

    def install(self):
        """Time a delivery's ``Work.call`` (the stacked calls) and give each member thread a profiler; returns an
        undo."""
        from pipeline.training import set_engine

        clock = self
        original_init, original_main = set_engine.Work.__init__, set_engine._Member._main
        # One timed wrapper per stacked call: the barrier groups the deliveries' jobs by the identity of their call,
        # and a wrapper per delivery would have each job train alone (the records before e66bf1a's did).
        wrappers: dict[Any, Any] = {}

        def timed_call(run):
            def timed(jobs):
                t = time.perf_counter()
                try:
                    return run(jobs)
                finally:
                    clock.stacked += time.perf_counter() - t

            return timed

        def work_init(self, call, given, result=None):
            # a delivery's local training (set_engine.batched), not a run's client messages (park: the delivery's
            # whole wall time)
            if set_engine._LOCAL.member.delivery:
                if call not in wrappers:
                    wrappers[call] = timed_call(call)
                call = wrappers[call]
            original_init(self, call, given, result)

        def profiled_main(self):
            if not clock.profiling:
                return original_main(self)
            profile = cProfile.Profile(time.thread_time)
            clock.profiles.append(profile)
            profile.enable()
            try:
                return original_main(self)
            finally:
                profile.disable()

        set_engine.Work.__init__ = work_init
        set_engine._Member._main = profiled_main

        def undo():
            set_engine.Work.__init__ = original_init
            set_engine._Member._main = original_main

        return undo


def study_params(train: int, valid: int) -> dict[str, Any]:
    import yaml

    from tools.gpu_study.device import PROFILE, merge_profile

    params = merge_profile(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(PROFILE.read_text()))
    params["train"] |= {"max_train_examples_per_client": train, "max_valid_examples_per_client": valid}
    return params


def _profiled_set(clock: _Clock, plans: list[Path]) -> tuple[float, float, dict]:
    """Run ``plans`` as one set: its wall seconds, those inside the stacked calls, and (``clock.profiling``) every
    thread's profile merged (pstats' table: function -> (.., calls, own, cumulative, ..))."""
    from pipeline.train import run_set

    clock.stacked, clock.profiles = 0.0, []
    main_profile = cProfile.Profile(time.thread_time)
    t = time.perf_counter()
    if clock.profiling:
        main_profile.enable()
    run_set(plans, track=False)
    main_profile.disable()
    wall = time.perf_counter() - t
    for p in plans:  # published outputs: the next set starts clean
        shutil.rmtree(Path("models") / p.stem, ignore_errors=True)
        shutil.rmtree(Path("reports/train") / p.stem, ignore_errors=True)
    stats = pstats.Stats(main_profile, *clock.profiles).stats if clock.profiling else {}
    return wall, clock.stacked, stats


def measure(work: Path, rounds: int, train: int, valid: int, repeats: int = 1) -> dict[str, Any]:
    """The study's set under the clock, as sets of 1 and of ``rounds`` rounds (the same runs): per round after the
    first (the difference, over ``rounds`` - 1), (a) the stacked calls' wall seconds, (b) the rest, each the least
    of ``repeats`` timed pairs; then both sets once more under the profilers: every thread's CPU seconds per later
    round by function, and (b)'s: all threads' less the stacked calls'."""
    import torch
    import yaml

    from benchmarks import engine
    from benchmarks.gpu_engine import _study_plans
    from pipeline.train import run_set
    from pipeline.training import local_batch

    params_path = work / "set-round-params.yaml"
    params_path.write_text(yaml.safe_dump(study_params(train, valid)))
    params = engine.build_workspace(work, str(params_path), tiny=True)
    d_tiny = json.loads((work / "models" / "backbone" / "config.json").read_text())["d_model"]
    params["model"] |= {"bottleneck": STUDY_ADAPTER[0] * STUDY_ADAPTER[1] // d_tiny}
    os.chdir(work)
    os.environ["FEDMEET_ROOT"] = str(work)
    run_set(engine.write_plans(work, params, ("fedavg",), rounds=1, prefix="warmup"), track=False)  # the cache
    sets = {n: _study_plans(work / f"r{n}", params, n, tiny=False) for n in (1, rounds)}
    later = rounds - 1

    clock = _Clock()
    undo = clock.install()
    try:
        walls, hosts = [], []
        for _ in range(repeats):
            (w1, a1, _), (wr, ar, _) = (_profiled_set(clock, sets[n]) for n in (1, rounds))
            walls.append((wr - w1) / later)
            hosts.append(((wr - ar) - (w1 - a1)) / later)
        clock.profiling = True
        before = dict(local_batch.STATS)
        one = _profiled_set(clock, sets[1])[2]
        middle = dict(local_batch.STATS)
        many = _profiled_set(clock, sets[rounds])[2]
        # the stacked calls a later round made: train groups, the jobs they held, validation groups
        grouping = {k: (local_batch.STATS[k] - 2 * middle[k] + before[k]) / later for k in local_batch.STATS}
    finally:
        undo()
    table = {
        fn: tuple((m - o) / later for m, o in zip(many[fn][1:4], one.get(fn, (0, 0, 0, 0))[1:4])) for fn in many
    }  # function -> (calls, own, cumulative) per later round
    cpu_all = sum(own for _, own, _ in table.values())
    cpu_stacked = sum(cum for fn, (_, _, cum) in table.items() if fn[2] == "timed" and fn[0] == __file__)
    best = min(range(repeats), key=lambda i: hosts[i])
    return {
        "device": f"cpu, {os.cpu_count()} cores (shared), {torch.get_num_threads()} torch threads",
        "runs": len(sets[rounds]),
        "rounds": rounds,
        "repeats": repeats,
        "examples_per_client": {"train": train, "valid": valid},
        "adapter_bottleneck": params["model"]["bottleneck"],
        "round_seconds": round(walls[best], 2),
        "stacked_seconds_per_round": round(walls[best] - hosts[best], 2),
        "host_seconds_per_round": round(hosts[best], 2),
        "host_seconds_per_round_all": [round(h, 2) for h in hosts],
        "host_cpu_seconds_per_round": round(cpu_all - cpu_stacked, 2),
        "stacked_cpu_seconds_per_round": round(cpu_stacked, 2),
        "stacked_calls_per_round": {k: round(v, 1) for k, v in grouping.items()},
        "top_own": _top(table, 1),
        "top_cumulative": _top(table, 2),
    }


def _top(table: dict, column: int) -> list[dict[str, Any]]:
    """The functions with the most CPU seconds per later round (``column`` 1: own, 2: cumulative)."""
    rows = sorted(table.items(), key=lambda kv: -kv[1][column])[:TOP]
    return [
        {
            "function": f"{Path(path).name}:{line}({name})",
            "calls_per_round": round(calls, 1),
            "own_s_per_round": round(own, 3),
            "cum_s_per_round": round(cum, 3),
        }
        for (path, line, name), (calls, own, cum) in rows
    ]


def _summary(res: dict[str, Any]) -> str:
    out = io.StringIO()
    print(
        f"{res['runs']} runs, round {res['round_seconds']} s: stacked (a) {res['stacked_seconds_per_round']} s, "
        f"host (b) {res['host_seconds_per_round']} s (of {res['host_seconds_per_round_all']}); CPU seconds: host "
        f"{res['host_cpu_seconds_per_round']}, stacked {res['stacked_cpu_seconds_per_round']}; stacked calls a round "
        f"{res.get('stacked_calls_per_round', 'not recorded')}",
        file=out,
    )
    for key in ("top_own", "top_cumulative"):
        print(f"-- {key}: CPU seconds a round after the first, all threads (own, cumulative, calls)", file=out)
        for r in res[key]:
            print(
                f"{r['own_s_per_round']:8.3f} {r['cum_s_per_round']:8.3f} {r['calls_per_round']:9} {r['function']}",
                file=out,
            )
    return out.getvalue()


def compare(records: dict[str, Any], before: str, after: str) -> str:
    """(b) and (a) of two records side by side, with after / before."""
    b, a = records[before], records[after]
    lines = [
        f"| a steady round of the {b['runs']}-run set | {before} | {after} | {after} / {before} |",
        "|---|---|---|---|",
    ]
    for key, what in (
        ("host_seconds_per_round", "(b) host wall seconds"),
        ("host_cpu_seconds_per_round", "(b) host CPU seconds, all threads"),
        ("stacked_seconds_per_round", "(a) stacked calls, wall seconds"),
        ("round_seconds", "round, wall seconds"),
    ):
        lines.append(f"| {what} | {b[key]} | {a[key]} | {a[key] / b[key]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train", type=int, default=16, help="train examples a client")
    ap.add_argument("--valid", type=int, default=6, help="valid examples a client")
    ap.add_argument("--label", default="current", help="the record's name in set_round.json")
    ap.add_argument("--out", default="reports/bench")
    ap.add_argument("--repeats", type=int, default=1, help="timed pairs of sets (the least host time counts)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print two records' ratios and exit")
    args = ap.parse_args(argv)
    path = Path(args.out) / "set_round.json"
    if args.compare:
        print(compare(json.loads(path.read_text()), *args.compare))
        return
    project = Path.cwd()
    work = Path(tempfile.mkdtemp(prefix="set-round-"))
    try:
        res = measure(work, args.rounds, args.train, args.valid, args.repeats)
    finally:
        os.chdir(project)
        shutil.rmtree(work, ignore_errors=True)
    records = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, records | {args.label: res})
    print(_summary(res))


if __name__ == "__main__":
    main()
