"""The apps `flwr run` loads (pyproject.toml [tool.flwr.app.components]): pipeline.federation.deployment's ServerApp
and ClientApp, with privacy's mechanisms registered (importing pipeline.privacy.seam registers them)."""

from __future__ import annotations

from pipeline.federation.deployment import client_app, server_app
from pipeline.privacy import seam  # noqa: F401 (registers privacy's mechanisms)

__all__ = ["client_app", "server_app"]  # Flower looks for an imported component in __all__
