"""What this machine gives a process: the cores it may use."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path


def cpu_count() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota
    (``docker run --cpus``) rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cores)
