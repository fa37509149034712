"""`python -m pipeline.federation local --experiment E`: a local deployment (pipeline.federation.cli)."""

from pipeline.common import cli
from pipeline.federation.cli import main

raise SystemExit(cli.run(main))
