"""``sift eval`` and ``sift demo``: the in-process runtime, with no queue."""

from __future__ import annotations
