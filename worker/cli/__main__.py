"""``python -m worker.cli``: the ``sift`` command without the console script."""

import sys

from worker.cli import app_for

app_for(sys.argv[1:])()
