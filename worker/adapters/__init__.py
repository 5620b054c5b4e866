"""Adapters: the real implementations of the ports in :mod:`worker.core.ports`."""
