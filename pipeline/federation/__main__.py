"""`python -m pipeline.federation local --experiment E`: a local deployment (pipeline.federation.local)."""
from pipeline.common.cli import run as run_cli
from pipeline.federation.local import main

raise SystemExit(run_cli(main))
