"""The ``sift`` console script: the command line, imported behind a Ctrl-C guard.

Importing the commands takes about half a second (pydantic, rich, httpx); a Ctrl-C in it
raised out of the import as a 13-frame traceback and a death by SIGINT, before any command
could say what it had done. Nothing has been done by then: one line, exit 130.
"""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as worker.cli._common has it (not imported: heavy)


def main() -> None:
    try:
        from worker.cli import app_for

        app = app_for(sys.argv[1:])  # a server command imports only its own module
    except KeyboardInterrupt:
        print("interrupted while starting; nothing was done", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    app()
