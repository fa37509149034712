"""The studies of METHOD.md section 7 that fedmeet reproduces: what each compares and where METHOD.md defines it.
Only the evaluation's MLflow logging reads it (training never imports it: rewording a study reruns no training).
"""
from __future__ import annotations

# study -> (what it compares, METHOD.md section)
STUDIES: dict[str, tuple[str, str]] = {
    "main": ("Main tables: 3 QMSum domain clients x 5 methods (AdaSingle, AdaCentralized, AdaFedAvg, AdaFedKD, "
             "AdaFedSelectKD)", "7.1 (methods: section 6)"),
    "iid": ("IID and balanced: each client gets a third of every domain; FedAvg vs FedKD vs SelectKD", "7.2"),
    "noniid": ("Non-IID and balanced: per domain 200 train / 40 valid / 40 test per seed", "7.3"),
    "extreme": ("Extreme non-IID and unbalanced: SAMSum as a 4th client, with and without it", "7.4"),
    "sampling": ("Client sampling: 2 of 3 clients chosen at random each round", "7.5"),
    "tau_sweep": ("Entropy threshold sweep over tau (selective KD gate, section 4)", "7.6"),
    "server": ("Server algorithms: FedAvg, FedProx, FedOPT, FedNova vs SelectKD", "7.7 (server: section 5)"),
    "new_client": ("New client: SAMSum joins after the QMSum clients converged (post) vs from the start (pre)",
                   "7.8"),
    "hardkd": ("Noun-verb hard KD vs SelectKD", "7.10 (POS analysis: 7.9)"),
    "privacy": ("Privacy vs utility: the same methods without and with differential privacy at several epsilon "
                "(the paper names DP as its next step)", "(none: beyond the paper; README 'Privacy')"),
}


def study_description(study: str) -> str:
    """The description of a study's MLflow experiment (an unlisted study by its name, section 7)."""
    what, section = STUDIES.get(study, (f"Study {study!r} (experiments with study: {study})", "7"))
    return (f"fedmeet study `{study}`: {what}. METHOD.md section {section}. One run per experiment of the "
            "`experiments` params (with the DVC experiment's name under `dvc exp run`). Compare methods "
            "on client_avg/ROUGE-1, ROUGE-2, ROUGE-L (plain rougeL, as in the tables) and avg_ROUGE, each with its "
            "95 % interval (_ci_low/_ci_high: bootstrap over test examples); per client: its child run and its "
            "adapter's LoggedModel (Models tab).")
