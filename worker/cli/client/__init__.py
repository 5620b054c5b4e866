"""``sift ingest``, ``sift search`` and ``sift batch``: the gateway's HTTP API from the shell.

Each command reads ``SIFT_URL`` (default ``http://127.0.0.1:8080``) and
``SIFT_API_KEY``. Expected failures (a bad input line, a 4xx naming a field,
no gateway listening) print one clear message and exit 1, without a traceback.
``sift batch`` exits 0 when every item is accounted for, even if some items
failed (it prints the failed count in red, by error type); ``--strict`` makes that exit 3.

Its modules, one per command, registered on ``app`` in this order (``sift --help`` lists them
so) as they are imported here: ``_ingest``, ``_search``, ``_batch``; ``_input`` reads and
checks the input files. What every command shares is in :mod:`worker.cli._common`.
"""

from __future__ import annotations

from worker.cli.client._input import MODES, Loaded, document_from, query_from

# isort: split
from worker.cli.client._ingest import ingest

# isort: split
from worker.cli.client._search import search

# isort: split
from worker.cli.client._batch import batch
from worker.constants import LANES

__all__ = ["LANES", "MODES", "Loaded", "batch", "document_from", "ingest", "query_from", "search"]
