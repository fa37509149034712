"""`python -m pipeline.federation local --experiment E`: a local deployment (pipeline.federation.cli)."""

from pipeline.common.cli import run as run_cli
from pipeline.federation.cli import main

raise SystemExit(run_cli(main))
