"""Experiments: the one reader of params `experiments:` (entries.py), of plan files (plans.py) and of the run-time
settings (settings.py); docs/ARCHITECTURE.md, "Experiments, plans and run-time settings"."""
