"""The ``sift`` command line (typer and rich); each module adds one group of commands.

The app is :data:`worker.cli._app.app`; importing the command modules here, in this order,
registers their commands on it (``sift --help`` lists them so).
"""

from __future__ import annotations

from worker.cli._app import app

# isort: split
from worker.cli import client as _client  # noqa: F401
from worker.cli import cost as _cost  # noqa: F401
from worker.cli import erase as _erase  # noqa: F401
from worker.cli import evaluate as _evaluate  # noqa: F401
from worker.cli import indexes as _indexes  # noqa: F401
from worker.cli import listing as _listing  # noqa: F401
from worker.cli import service as _service  # noqa: F401
from worker.cli import status as _status  # noqa: F401
from worker.cli import tenants as _tenants  # noqa: F401

__all__ = ["app"]
