"""The in-process runtime: ingest and search through the pipeline, with no queue.

The Celery tasks, the evaluation harness and the benchmarks all drive this.

    runtime = build_runtime(load_settings())
    runtime.ingest("docs", tenant="acme", documents=[DocumentIn(id="1", text="...")])
    result = runtime.search(SearchSpec(index="docs", query="..."), tenant="acme")
"""

from __future__ import annotations
