"""The pure core of the search: types, query rules, RRF, rank normalisation, policy, pipeline.

Nothing here does I/O; the ports in :mod:`worker.core.ports` are the only way out.
"""
