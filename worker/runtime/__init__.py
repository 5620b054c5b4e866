"""The pipeline in one worker process: built from the settings (:mod:`.bootstrap`), driven
with no queue (:mod:`.inprocess`: ingest and search), the process's CPU slots (:mod:`.slots`)
and the per-process limit on model calls (:mod:`.ratelimit`).

The Celery tasks, ``sift eval`` and the benchmarks drive it. This file imports nothing.
"""
