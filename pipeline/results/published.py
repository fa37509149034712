"""The published AdaFedSelecKD numbers (Feng et al., TASLP 2024, arXiv 2308.03275) as data, printed beside ours by
`report`; transcribed from METHOD.md sections 7 and 9, and the tests check them against its text."""

from __future__ import annotations

from dataclasses import dataclass

# Method keys as pipeline.experiments.methods names them, in the paper's column order, with the paper's names.
METHOD_ORDER: tuple[str, ...] = ("single", "centralized", "fedavg", "fedkd", "fedselectkd")
PAPER_METHOD_NAMES: dict[str, str] = {
    "single": "AdaSingle",
    "centralized": "AdaCentralized",
    "fedavg": "AdaFedAvg",
    "fedkd": "AdaFedKD",
    "fedselectkd": "AdaFedSelectKD",
    "hardkd": "Noun-verb hard KD",
    "fedprox": "FedProx",
    "fedopt": "FedOPT",
    "fednova": "FedNova",
    "post_addition": "post-addition",
    "pre_addition": "pre-addition",
}


@dataclass(frozen=True)
class Rouge3:  # ROUGE-1 / ROUGE-2 / ROUGE-L F1 x 100 as printed in the paper
    rouge1: float
    rouge2: float
    rougeL: float

    @property
    def avg_rouge(self) -> float:  # the tables' avg_rouge: the mean of the three (comparisons.published_difference)
        return (self.rouge1 + self.rouge2 + self.rougeL) / 3


def _tables(text: str) -> dict[str, dict[str, dict[str, Rouge3]]]:
    """Parse lines 'backbone client cell cell cell cell cell' of 'r1/r2/rl' cells in METHOD_ORDER."""
    tables: dict[str, dict[str, dict[str, Rouge3]]] = {}
    for line in text.strip().splitlines():
        backbone, client, *cells = line.split()
        tables.setdefault(backbone, {})[client] = {
            method: Rouge3(*(float(x) for x in cell.split("/")))
            for method, cell in zip(METHOD_ORDER, cells, strict=True)
        }
    return tables


# Table III: {backbone: {client: {method: Rouge3}}}.
MAIN_TABLE: dict[str, dict[str, dict[str, Rouge3]]] = _tables("""
bart-large Academic 24.83/5.70/17.24 26.74/7.95/20.73 25.76/6.18/18.70 26.66/7.02/19.26 27.09/7.62/19.79
bart-large Committee 32.38/13.08/23.24 34.59/15.79/25.32 33.80/14.04/24.19 34.12/14.65/24.83 34.70/15.19/25.37
bart-large Product 31.83/11.11/21.27 34.53/12.78/23.71 32.50/12.19/22.45 33.09/12.50/23.11 33.32/12.86/23.53
bart-base Academic 23.97/5.70/17.81 25.66/6.72/18.88 24.19/6.19/18.20 24.84/6.25/18.32 25.25/6.48/18.98
bart-base Committee 27.68/9.41/19.30 28.61/11.23/21.21 28.09/9.87/20.31 28.21/10.40/20.49 28.88/11.14/21.07
bart-base Product 28.47/9.86/19.85 30.83/11.15/20.92 29.34/10.47/20.42 29.89/10.56/20.74 30.41/11.25/21.15
led-large Academic 24.28/6.03/17.58 26.30/6.94/18.64 25.13/6.34/18.19 25.49/6.58/18.30 25.92/7.09/18.67
led-large Committee 32.69/13.03/22.58 33.71/14.94/23.87 32.72/13.88/23.22 32.98/14.39/23.46 33.53/14.95/23.85
led-large Product 30.12/9.85/19.70 32.72/10.75/22.17 30.43/9.93/21.66 31.69/10.12/21.93 32.07/10.67/22.64
""")

# Table V (BART-large): average ROUGE per client for each server algorithm (SelectKD = FedAvg server + selective KD).
SERVER_AVG_ROUGE: dict[str, dict[str, float]] = {
    "fedavg": {"Academic": 16.88, "Committee": 24.01, "Product": 22.38},
    "fedopt": {"Academic": 17.58, "Committee": 24.36, "Product": 22.72},
    "fedprox": {"Academic": 17.89, "Committee": 24.57, "Product": 23.04},
    "fednova": {"Academic": 18.09, "Committee": 24.81, "Product": 23.11},
    "fedselectkd": {"Academic": 18.17, "Committee": 25.08, "Product": 23.23},
}

# New client (SelectKD, BART-large), average ROUGE; SAMSum absent from the 3-client setting.
NEW_CLIENT_AVG_ROUGE: dict[str, dict[str, float]] = {
    "three_clients": {"Academic": 18.17, "Committee": 25.08, "Product": 23.23},
    "post_addition": {"Academic": 18.62, "Committee": 26.07, "Product": 23.79, "SAMSum": 34.25},
    "pre_addition": {"Academic": 18.87, "Committee": 26.40, "Product": 24.32, "SAMSum": 34.86},
}

# Section 7.9: share of target-word updates that used KD, round 1 to the best round.
KD_USAGE_RATIO: dict[str, float] = {"Academic": 0.86, "Committee": 0.88, "Product": 0.89}

# Section 7.12: human evaluation, SelectKD vs FedAvg over 60 meetings (20 per domain).
HUMAN_EVAL: dict[str, dict[str, int]] = {"fedavg": {"win": 52, "tie": 4, "loss": 4}}
HUMAN_EVAL_MEETINGS_PER_DOMAIN = 20


def backbone_key(name: str | None) -> str | None:
    """The :data:`MAIN_TABLE` key of a backbone name or HF id ("facebook/bart-large"), None if the paper has none."""
    n = (name or "").lower().rsplit("/", 1)[-1]
    return next((key for key in MAIN_TABLE if n.startswith(key.split("-")[0]) and key.split("-")[1] in n), None)
