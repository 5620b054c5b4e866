"""Sift's worker: the search pipeline, its adapters, and the Celery tasks that run it."""
