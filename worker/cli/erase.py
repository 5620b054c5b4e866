"""``sift erase ID``: erase one finished search or batch of the caller's through the gateway
(``DELETE /v1/searches/{id}``, ``DELETE /v1/batches/{id}/results``; ``SIFT_URL``,
``SIFT_API_KEY``): its query, results and everything else Sift stored of it.

    sift erase srch_0123...   # a search
    sift erase bat_0123... --json

An erase whose answer is lost (a gateway restarting, a 503) is sent again for up to 2 minutes:
erasing again answers as the first erase did. A Ctrl-C while it is sent says the outcome is
unknown and how to learn it (exit 130).

One command for both kinds, told apart by the id's prefix: ``sift search`` and ``sift batch``
take a query and a file, so ``sift search erase ID`` would search for "erase".
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from worker.cli._app import app
from worker.cli._common import EXIT_INTERRUPTED, _err, _expected_errors, _out
from worker.cli._http import RETRY_SECONDS, gateway
from worker.constants import BATCH_ID_PREFIX, SEARCH_ID_PREFIX

# the id's prefix -> what it names and the route that erases it
_ROUTES = {
    SEARCH_ID_PREFIX: ("search", "/v1/searches/{id}"),
    BATCH_ID_PREFIX: ("batch", "/v1/batches/{id}/results"),
}


def _route(job_id: str) -> tuple[str, str]:
    """The kind and path of the erase of ``job_id``, or a usage error naming the argument.

    >>> _route("srch_ab")
    ('search', '/v1/searches/srch_ab')
    """
    for prefix, (kind, path) in _ROUTES.items():
        if job_id.startswith(prefix) and job_id[len(prefix) :].isalnum():
            return kind, path.replace("{id}", job_id)
    raise typer.BadParameter(
        f"{job_id!r} is not a search id ({SEARCH_ID_PREFIX}...) nor a batch id "
        f"({BATCH_ID_PREFIX}...)",
        param_hint="'ID'",
    )


@app.command("erase")
def erase(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="a search's or a batch's id")],
    json_out: Annotated[bool, typer.Option("--json", help="print the answer as JSON")] = False,
) -> None:
    """Erase a finished search or batch: its query, results (hits' text, traces), errors and
    usage, all gone from Redis; it then reads as erased (HTTP 410). A search or batch not
    finished is refused, nothing erased: cancel a batch first (DELETE /v1/batches/ID) or wait.
    Erasing again is harmless."""
    kind, path = _route(job_id)
    try:
        with _expected_errors(), gateway() as client:
            # safe to send again: an erase repeated answers as the first did
            answer = client.json(
                "DELETE", path, fields=("id", "erased_at"), retry_for=RETRY_SECONDS
            )
    except KeyboardInterrupt:  # it may have reached the gateway: say so, and how to know
        _err().print(
            f"interrupted: {kind} {job_id} may or may not be erased; `sift erase {job_id}` "
            "again tells (erasing again is harmless)",
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if json_out:
        typer.echo(json.dumps(answer))
        return
    _out().print(f"erased {kind} {job_id} (at {answer['erased_at']})", soft_wrap=True)
