"""Coverage and width of the several-seeds paired interval (``pipeline.results.stats.paired_difference``) by
simulation, in the regimes our data has (docs/statistics.md, "Coverage"). ``python -m benchmarks.interval_coverage
--write docs/statistics.md`` rewrites the table between the coverage markers there; tests/test_interval_coverage.py
asserts the coverages and that the committed table is this module's output.

One replicate is a fresh draw of two methods' scores on QMSum's test design: three clients of 49, 66 and 129 queries
on 9, 6 and 20 meetings (consecutive queries share a meeting, as in the data). A method's score on example i under
seed s is ``BASE + E_i + ME_mi + SE_msi + meeting_mg + seed_msc``: E the example's difficulty (sd 6, both methods),
ME the method x example effect (sd 1.5), SE the seed x example noise (sd 2.5), meeting the method x meeting effect
(sd ``meeting_sd``, 0 outside the clustered regimes), seed the run's seed effect, 70 % of its variance shared by
the clients and 30 % per client, of sd ``rho`` x the one-seed example-level standard error of the client-average
difference (per method sd / sqrt 2, so a client's difference has sd ``rho`` x that SE, and the client average's,
sqrt(0.7 + 0.3 / 3) of it, about 0.89 ``rho`` x that SE). The two methods are exchangeable,
so the true difference is 0 whatever the distribution; the interval covers when it contains 0. ``bounded`` regimes
draw ME and SE from t with 3 degrees of freedom (scaled to the same sd) and clip every score at 0 (ROUGE's floor).

The nested design (``--nested``; ``pipeline.results.stats.nested_interval``, docs/statistics.md "Seeds that redraw
the test sets"): each seed draws its own test examples and meetings from the population, so a seed is one fresh
one-seed draw of the model above (new E, ME, SE, meeting and seed effects, the same client sizes), and the interval
gets each seed's A - B with that seed's meetings.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.results.stats import BootstrapConfig, nested_interval, paired_difference

SIZES = (49, 66, 129)  # QMSum test queries: Academic, Committee, Product
MEETINGS = (9, 6, 20)
BASE, EXAMPLE_SD, METHOD_EXAMPLE_SD, SEED_EXAMPLE_SD = 10.0, 6.0, 1.5, 2.5
SHARED = 0.7  # share of the seed-effect variance common to the clients
# the one-seed example-level SE of the client-average difference (independent examples, no meeting effect)
ONE_SEED_SE = math.sqrt(2 * (METHOD_EXAMPLE_SD**2 + SEED_EXAMPLE_SD**2) * sum(1 / n for n in SIZES)) / len(SIZES)
CFG = BootstrapConfig(n_resamples=1000, seed=0)
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
MARKERS = {False: (BEGIN, END), True: ("<!-- nested-coverage:begin -->", "<!-- nested-coverage:end -->")}


@dataclass(frozen=True)
class Regime:
    name: str
    rho: float  # one client's seed-effect sd of the difference / ONE_SEED_SE (the client average's: 0.89 rho)
    bounded: bool = False  # t3 tails and scores clipped at 0
    meeting_sd: float = 0.0  # method x meeting effect sd


REGIMES = (
    Regime("Gaussian, rho 0", 0.0),
    Regime("Gaussian, rho 1", 1.0),
    Regime("Gaussian, rho 3", 3.0),
    Regime("bounded at 0, t3 tails, rho 1", 1.0, bounded=True),
    Regime("bounded at 0, t3 tails, rho 3", 3.0, bounded=True),
    Regime("clustered by meeting (sd 0.7), rho 0", 0.0, meeting_sd=0.7),
    Regime("clustered by meeting (sd 0.7), rho 1", 1.0, meeting_sd=0.7),
)


# Per client, each query's meeting: consecutive queries, meetings as equal as the counts allow.
MEETING_IDS = [
    np.repeat(np.arange(g), [len(c) for c in np.array_split(np.arange(n), g)]) for n, g in zip(SIZES, MEETINGS)
]


def _noise(rng: np.random.Generator, sd: float, size, bounded: bool) -> np.ndarray:
    return sd * rng.standard_t(3, size) / math.sqrt(3.0) if bounded else rng.normal(0.0, sd, size)


def draw(rng: np.random.Generator, regime: Regime, seeds: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One replicate: per client, method A's and method B's scores [seeds, n]."""
    seed_sd = regime.rho * ONE_SEED_SE / math.sqrt(2)  # per method
    shared = {m: rng.normal(0.0, seed_sd * math.sqrt(SHARED), seeds) for m in "ab"}
    out: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for n, g, meetings in zip(SIZES, MEETINGS, MEETING_IDS):
        example = rng.normal(0.0, EXAMPLE_SD, n)
        for m in "ab":
            seed = shared[m] + rng.normal(0.0, seed_sd * math.sqrt(1 - SHARED), seeds)
            meeting = rng.normal(0.0, regime.meeting_sd, g)[meetings]
            score = (
                BASE
                + example
                + meeting
                + _noise(rng, METHOD_EXAMPLE_SD, n, regime.bounded)
                + _noise(rng, SEED_EXAMPLE_SD, (seeds, n), regime.bounded)
                + seed[:, None]
            )
            out[m].append(np.maximum(score, 0.0) if regime.bounded else score)
    return out["a"], out["b"]


def coverage(
    regime: Regime, seeds: int, replicates: int, clustered: bool = True, nested: bool = False
) -> tuple[float, float]:
    """(coverage of the true difference 0, mean width) of the 95 % interval over ``replicates`` seeded draws;
    ``clustered``: the interval is given the meetings; ``nested``: every seed its own test examples."""
    rng = np.random.default_rng([seeds, REGIMES.index(regime), *[1] * nested])
    # ids distinct across clients: no meeting in two (the clients are QMSum's domains)
    clusters = [m + 100 * c for c, m in enumerate(MEETING_IDS)] if clustered else None
    hits, width = 0, 0.0
    for _ in range(replicates):
        if nested:  # a seed: a fresh one-seed draw of examples, meetings and seed effects
            per_seed = [[a[0] - b[0] for a, b in zip(*draw(rng, regime, 1))] for _ in range(seeds)]
            r = nested_interval(per_seed, CFG, [clusters] * seeds)
        else:
            r = paired_difference(*draw(rng, regime, seeds), CFG, clusters=clusters)
        hits += r.low <= 0.0 <= r.high
        width += r.high - r.low
    return hits / replicates, width / replicates


def table(seed_counts: tuple[int, ...] = (2, 3, 5, 10), replicates: int = 1000, nested: bool = False) -> str:
    """The markdown table of docs/statistics.md: coverage (mean width) per regime and seed count."""
    lines = [
        f"| regime | {' | '.join(f'{s} seeds' for s in seed_counts)} |",
        "|---|" + "---|" * len(seed_counts),
    ]
    for regime in REGIMES:
        lines.append(
            f"| {regime.name} | " + " | ".join(cell(regime, s, replicates, nested) for s in seed_counts) + " |"
        )
    return "\n".join(lines)


def cell(regime: Regime, seeds: int, replicates: int = 1000, nested: bool = False) -> str:
    """One cell of :func:`table`: 'coverage (mean width)'."""
    covered, width = coverage(regime, seeds, replicates, nested=nested)
    return f"{covered:.3f} ({width:.2f})"


def documented_cells(markdown: str, nested: bool = False) -> dict[tuple[str, int], str]:
    """The cells of the table between the (nested) coverage markers of ``markdown``, by (regime name, seeds)."""
    begin, end = MARKERS[nested]
    rows = [line.strip("|").split(" | ") for line in markdown.split(begin, 1)[1].split(end, 1)[0].split("\n")]
    rows = [[c.strip() for c in r] for r in rows if len(r) > 1]
    seeds = [int(h.split()[0]) for h in rows[0][1:]]
    return {(r[0], s): c for r in rows[1:] for s, c in zip(seeds, r[1:])}


def with_table(text: str, block: str, nested: bool = False) -> str:
    """``text`` with the part between the (nested) coverage markers replaced by ``block``."""
    begin, stop = MARKERS[nested]
    start, end = text.find(begin), text.find(stop)
    if start < 0 or end < start:
        raise ValueError(f"no {begin} ... {stop} block")
    return text[: start + len(begin)] + "\n" + block + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.interval_coverage", description=__doc__.split("\n")[0])
    parser.add_argument("--replicates", type=int, default=1000)
    parser.add_argument("--write", type=Path, help="rewrite the coverage block of this markdown file")
    parser.add_argument("--nested", action="store_true", help="seeds that redraw the test sets: 2, 3 and 5 seeds")
    args = parser.parse_args(argv)
    block = table((2, 3, 5) if args.nested else (2, 3, 5, 10), args.replicates, args.nested)
    if args.write:
        text = with_table(args.write.read_text(encoding="utf-8"), block, args.nested)
        args.write.write_text(text, encoding="utf-8")
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
