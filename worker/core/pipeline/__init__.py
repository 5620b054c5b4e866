"""The search pipeline over its ports: retrieve, admit and fuse, rerank, normalise, map back.

This is DESIGN.md §2 and §4 in one place; everything it touches outside is a port. Its
modules, by what they hold:

* ``_search``: :class:`SearchPipeline`, the algorithm; ``_config``: :class:`PipelineConfig`;
* ``_retrieval``: :class:`Retrieval`, the probe, the channels and their fusion into candidates;
* ``_model_calls``: :class:`ModelCalls`, the standard lane's model calls and their accounting;
* ``_result``: the result of what the model answered (normalised, or the failure policy);
* ``_run``: :class:`RerankRun`, what the rerank stage did, and it as JSON (a kept answer);
* ``_prepared``: :class:`Prepared`, the first half as data, and it as JSON (the economy lane);
* ``_hits``: how a result and its trace show the candidates.

Import the names from here: ``from worker.core.pipeline import SearchPipeline``.
"""

from __future__ import annotations

import logging

from worker.core.pipeline._config import FailurePolicy, PipelineConfig
from worker.core.pipeline._hits import shown_metadata, stage_seconds
from worker.core.pipeline._model_calls import WAIT_CHECK_SECONDS, BeforeModel
from worker.core.pipeline._prepared import (
    Prepared,
    as_stored,
    dump_prepared,
    holds_filters,
    load_prepared,
    shown_digest,
)
from worker.core.pipeline._run import RerankRun, dump_run, load_run, usage_by_type
from worker.core.pipeline._search import SearchPipeline

log = logging.getLogger(__name__)


__all__ = [
    "WAIT_CHECK_SECONDS",
    "BeforeModel",
    "FailurePolicy",
    "PipelineConfig",
    "Prepared",
    "RerankRun",
    "SearchPipeline",
    "as_stored",
    "dump_prepared",
    "dump_run",
    "holds_filters",
    "load_prepared",
    "load_run",
    "shown_digest",
    "shown_metadata",
    "stage_seconds",
    "usage_by_type",
]
