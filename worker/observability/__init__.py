"""What Sift tells about itself: the Prometheus metrics (:mod:`.metrics`) and the job id on
every log record (:mod:`.logcontext`).

Both depend on prometheus-client and :mod:`worker.constants` at most, so the gateway imports
them as the worker does. This file imports nothing.
"""
