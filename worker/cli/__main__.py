"""``python -m worker.cli``: the ``sift`` command without the console script."""

from worker.cli import app

app()
