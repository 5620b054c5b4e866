"""Whether a process id runs: for the files and folders named after the process that wrote
them (metrics files, a metrics folder, a results file being written), removed once it is gone."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (another user's counts: it is not ours to judge gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
