"""`python -m pipeline.federation local --experiment E`: a local deployment (pipeline.federation.localhost)."""

from pipeline.common.cli import run as run_cli
from pipeline.federation.localhost import main

raise SystemExit(run_cli(main))
