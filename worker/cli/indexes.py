"""``sift indexes``, ``sift index show|set|delete`` and ``sift documents list|get|delete``:
the index lifecycle from the shell, through the gateway (``SIFT_URL``, ``SIFT_API_KEY``).

Deletes are jobs: the command submits one, waits for it to finish (``?wait=``, then polls
``GET /v1/ingestions/{id}``) and prints how many documents went. ``--json`` prints the raw
answers instead of tables.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console

from worker.cli._app import app
from worker.cli._common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    _err,
    _expected_errors,
    _out,
    one_of,
)
from worker.cli._http import (
    RETRY_SECONDS,
    Gateway,
    GatewayError,
    gateway,
    index_name,
    segment,
    submit_retry_seconds,
    utf8_text,
)
from worker.cli._output import counted, local_time, plain, print_fitted, progress_bar
from worker.constants import (
    MAX_DOCUMENTS_PER_REQUEST,
    MAX_PAGE_SIZE,
    MAX_WAIT_SECONDS,
)
from worker.contract import IndexSettingsPatch
from worker.errors import validation_message

index_app = typer.Typer(
    help="Show, set the search settings of, or delete one of your indexes.", no_args_is_help=True
)
documents_app = typer.Typer(help="List, read or delete documents.", no_args_is_help=True)
app.add_typer(index_app, name="index")
app.add_typer(documents_app, name="documents")


#: ``--method``'s choices (the API's ``fusion.method``)
FUSION_METHODS = ("rrf", "linear")


JsonOut = Annotated[bool, typer.Option("--json", help="print the raw answer as JSON")]
IndexOption = Annotated[str, typer.Option("--index", callback=index_name, help="the index")]
IndexArgument = Annotated[str, typer.Argument(callback=index_name, help="the index")]
DEFAULT_DOCUMENTS_SHOWN = 20
PREVIEW_SHOWN = 60  # characters of each text in the table (--json has the API's 200)
INDEX_FIELDS = ("name", "documents")  # an index's metadata holds them (else: not Sift's)
JOB_FIELDS = ("id", "status")  # a job's answer holds them


def _print_json(console: Console, value: Any) -> None:
    console.print_json(json.dumps(value))


def _settings(index: dict[str, Any]) -> str:
    """The index's own search settings in one cell; "defaults" when none is set."""
    settings = index.get("settings") or {}
    fusion = settings.get("fusion") or {}
    weights = fusion.get("weights") or {}
    parts = [f"{fusion['method']} fusion"] if fusion.get("method") else []
    parts += [f"{c} weight {weights[c]:g}" for c in ("bm25", "knn") if weights.get(c) is not None]
    if fusion.get("rank_constant") is not None:
        parts.append(f"rank constant {fusion['rank_constant']}")
    if settings.get("candidate_limit") is not None:
        parts.append(f"candidates {settings['candidate_limit']}")
    return ", ".join(parts) or "defaults"


def _print_indexes(console: Console, indexes: list[dict[str, Any]]) -> None:
    columns = ["name", "documents", "backend", "embedding model", "dims", "last write", "settings"]
    rows = [
        [
            plain(i["name"]),
            str(i["documents"]),
            plain(i["backend"]),
            plain(i.get("embedding_model") or "–"),
            str(i.get("dimensions") or "–"),
            local_time(i.get("last_write_at")),
            _settings(i),
        ]
        for i in indexes
    ]
    print_fitted(
        console,
        f"{len(indexes)} index(es)",
        columns,
        rows,
        drop_order=["backend", "dims", "last write", "embedding model"],
        wrapped=("settings",),
        right=("documents", "dims"),
    )


def _finish(client: Gateway, job: dict[str, Any]) -> dict[str, Any]:
    """The delete job once final (it was submitted with ``?wait=``; poll if still running)."""
    if job.get("status") in ("succeeded", "failed"):
        return job
    return client.poll(f"/v1/ingestions/{job['id']}")


def _delete_interrupted(job: dict[str, Any] | None) -> str:
    """What Ctrl-C left of a delete: its job runs on once accepted (it has no cancel).

    >>> _delete_interrupted({"id": "i1"})[:55]
    'interrupted: delete job i1 runs on; `sift ingestions` s'
    """
    if job is None:
        return (
            "interrupted while submitting: the delete may have been accepted and run on; "
            "`sift ingestions --limit 1` shows it"
        )
    return (
        f"interrupted: delete job {job['id']} runs on; `sift ingestions` shows it, "
        f"GET /v1/ingestions/{job['id']} its outcome"
    )


@contextmanager
def _interruptible(submitted: list[dict[str, Any]]) -> Iterator[None]:
    """A Ctrl-C while a delete is submitted or waited for: one line naming the job it left
    running (the last of ``submitted``), exit 130; it exited 130 with nothing said."""
    try:
        yield
    except KeyboardInterrupt:
        _err().print(_delete_interrupted(submitted[-1] if submitted else None), soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _submit_delete(client: Gateway, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """A delete job's submission, with an Idempotency-Key of its own, sent again with it
    through any transient failure (as ``sift ingest`` sends its upserts): one whose answer
    was lost (a proxy's 502 or 504, a read timeout, a ``503 unavailable`` from Redis stalling
    after the job's write) is answered with the job it made, where a second job would delete
    nothing and the command say the index did not exist. The tries outlast the key's claim left by a
    gateway killed before it made the job (``409 idempotency_key_in_progress``), as ``sift
    search``'s do. A failure that ends them says the job may run, unless it proves not."""
    try:
        job: dict[str, Any] = client.json(
            method, path, params={"wait": MAX_WAIT_SECONDS}, fields=JOB_FIELDS,
            headers={"Idempotency-Key": uuid.uuid4().hex}, retry_for=submit_retry_seconds(),
            **kwargs,
        )  # fmt: skip
    except GatewayError as exc:
        if not exc.transient or exc.unapplied:
            raise
        raise GatewayError(
            f"{exc.message}; the delete may have been accepted and run: `sift ingestions` lists it",
            status_code=exc.status_code,
        ) from exc
    return job


def _check_found(client: Gateway, index: str, jobs: list[dict[str, Any]]) -> int:
    """A delete that removed nothing from ``index``: the gateway's 404 (``index 'NAME' does not
    exist``, exit 1, as every other command says it) when the index is not there and the
    delete voided no ingest of it. A delete job on a name nobody has succeeds with 0
    deleted, which passed a typo's delete for done; but one sent while the index's first
    ingests were accepted and not yet written did its work (they write nothing it took),
    and the command said the index did not exist, exit 1. Answers how many ingest jobs it
    voided (:func:`_voided`)."""
    if any(j.get("status") != "succeeded" or j.get("deleted") for j in jobs):
        return 0
    try:
        client.json("GET", f"/v1/indexes/{segment(index)}", retry_for=RETRY_SECONDS)
    except GatewayError as exc:
        voided = _voided(client, index, jobs[-1]) if exc.status_code == 404 else 0
        if not voided:
            raise
        return voided
    return 0


def _voided(client: Gateway, index: str, job: dict[str, Any]) -> int:
    """The upserts of ``index`` accepted before the delete ``job`` (listed after it in ``GET
    /v1/ingestions``, newest first) and after any drop of the index before it, that have
    not written all their documents: still queued or running, or done with fewer upserted
    (the delete landed first, so they write none of what it took)."""
    seen = False
    voided = 0
    for page in client.pages("/v1/ingestions", {"page_size": MAX_PAGE_SIZE}, "ingestions"):
        for other in page["ingestions"]:
            if other.get("id") == job["id"]:
                seen = True
            elif not seen or other.get("index") != index:
                continue
            elif other.get("operation") == "drop":
                return voided
            elif other.get("operation") == "upsert" and _unwritten(other):
                voided += 1
    return voided


def _unwritten(upsert: dict[str, Any]) -> bool:
    """An upsert job that has not written all of its documents (yet).

    >>> _unwritten({"status": "succeeded", "documents": 2, "upserted": 0})
    True
    """
    if upsert.get("status") in ("queued", "running"):
        return True
    return (
        upsert.get("status") == "succeeded" and (upsert.get("upserted") or 0) < upsert["documents"]
    )


def _report(
    console: Console, job: dict[str, Any], what: str, json_out: bool, voided: int = 0
) -> None:
    """The delete's outcome; ``voided``: the ingest jobs whose writes it took before they
    landed (:func:`_check_found`), said after the count (on stderr with ``--json``)."""
    if json_out:
        _print_json(console, job)
    if job.get("status") != "succeeded":
        error = job.get("error") or {}
        _err().print(
            f"[bold red]error:[/] {what} failed: {plain(error.get('message', job.get('status')))}"
        )
        raise typer.Exit(EXIT_ERROR)
    note = (
        f": none was written yet; {voided} ingest job(s) of the index accepted before it "
        "write none of what it deleted (`sift ingestions` lists them)"
        if voided
        else ""
    )
    if json_out and note:
        _err().print(f"deleted 0 document(s) {what}{note}", soft_wrap=True)
    elif not json_out:
        console.print(f"deleted [bold]{job.get('deleted', 0)}[/] document(s) {what}{note}")


@app.command("indexes")
def indexes(json_out: JsonOut = False) -> None:
    """List your indexes: documents, backend, embedding model, dimensions, last write."""
    console = _out()
    with _expected_errors(), gateway() as client:
        found: list[dict[str, Any]] = []
        for page in client.pages("/v1/indexes", {"page_size": MAX_PAGE_SIZE}, "indexes"):
            found += page["indexes"]
    if json_out:
        _print_json(console, found)
    else:
        _print_indexes(console, found)


@index_app.command("show")
def index_show(name: IndexArgument, json_out: JsonOut = False) -> None:
    """Show one of your indexes."""
    console = _out()
    with _expected_errors(), gateway() as client:
        found = client.json(
            "GET", f"/v1/indexes/{segment(name)}", fields=INDEX_FIELDS, retry_for=RETRY_SECONDS
        )
    if json_out:
        _print_json(console, found)
    else:
        _print_indexes(console, [found])


def settings_patch(
    bm25_weight: float | None,
    knn_weight: float | None,
    rank_constant: int | None,
    candidate_limit: int | None,
    reset: bool,
    method: str | None = None,
) -> dict[str, Any]:
    """The ``PATCH /v1/indexes/{index}`` body of ``sift index set``'s options: only what was
    given; ``reset`` first clears every setting (null), so the options given are all that stay.

    >>> settings_patch(None, 0.5, None, None, False)
    {'fusion': {'weights': {'knn': 0.5}}}
    >>> settings_patch(None, None, None, 40, True)
    {'fusion': None, 'candidate_limit': 40}
    >>> settings_patch(None, None, None, None, False, method="linear")
    {'fusion': {'method': 'linear'}}
    """
    weights = {c: w for c, w in (("bm25", bm25_weight), ("knn", knn_weight)) if w is not None}
    fusion: dict[str, Any] = {}
    if weights:
        fusion["weights"] = weights
    if rank_constant is not None:
        fusion["rank_constant"] = rank_constant
    if method is not None:
        fusion["method"] = method
    body: dict[str, Any] = {"fusion": None, "candidate_limit": None} if reset else {}
    if fusion:
        body["fusion"] = fusion
    if candidate_limit is not None:
        body["candidate_limit"] = candidate_limit
    return body


# ``sift index set``'s option for each field of the API's settings (the longest path first)
SETTING_OPTIONS = {
    ("fusion", "weights", "bm25"): "'--bm25-weight'",
    ("fusion", "weights", "knn"): "'--knn-weight'",
    ("fusion", "weights"): "'--bm25-weight' / '--knn-weight'",
    ("fusion", "rank_constant"): "'--rank-constant'",
    ("fusion", "method"): "'--method'",
    ("candidate_limit",): "'--candidate-limit'",
}


def checked_patch(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` if the API takes it (the gateway's own model checks it here), else a usage
    error naming the option, not the API's field (``fusion.weights.knn``), exit 2.

    >>> checked_patch({"fusion": {"weights": {"knn": 0.5}}})
    {'fusion': {'weights': {'knn': 0.5}}}
    """
    try:
        IndexSettingsPatch.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = tuple(str(part) for part in first["loc"])
        hint = next((o for path, o in SETTING_OPTIONS.items() if where[: len(path)] == path), None)
        message = validation_message(first["msg"])
        raise typer.BadParameter(message, param_hint=hint) from None
    return body


@index_app.command("set")
def index_set(
    name: IndexArgument,
    bm25_weight: Annotated[
        float | None, typer.Option("--bm25-weight", help="BM25's weight in the fusion (>= 0)")
    ] = None,
    knn_weight: Annotated[
        float | None, typer.Option("--knn-weight", help="kNN's weight in the fusion (>= 0)")
    ] = None,
    rank_constant: Annotated[
        int | None, typer.Option("--rank-constant", help="RRF's rank constant (>= 1)")
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(
            "--method",
            callback=one_of(FUSION_METHODS),
            help="the fusion: rrf (ranks) or linear (min-max normalised scores)",
        ),
    ] = None,
    candidate_limit: Annotated[
        int | None, typer.Option("--candidate-limit", help="the rerank candidate window")
    ] = None,
    reset: Annotated[
        bool, typer.Option("--reset", help="clear every setting first (back to the defaults)")
    ] = False,
    json_out: JsonOut = False,
) -> None:
    """Set an index's own search settings: fusion method, weights, rank constant, candidate
    window.

    A search's own settings override them, and they override the defaults (SIFT_FUSION_*,
    SIFT_RERANK_CANDIDATE_LIMIT). Settings not given stay as they are.
    """
    console = _out()
    body = settings_patch(
        bm25_weight,
        knn_weight,
        rank_constant,
        candidate_limit,
        reset,
        method=method,
    )
    if not body:
        _err().print("[bold red]error:[/] give at least one setting (or --reset)")
        raise typer.Exit(EXIT_USAGE)
    checked_patch(body)  # a bad value names its option before anything is sent
    with _expected_errors(), gateway() as client:
        found = client.update_index(name, body)
    if json_out:
        _print_json(console, found)
    else:
        _print_indexes(console, [found])


@index_app.command("delete")
def index_delete(
    name: IndexArgument,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    json_out: JsonOut = False,
) -> None:
    """Delete all of your documents in an index (other tenants' stay)."""
    console = _out()
    if not yes:
        typer.confirm(f"Delete all of your documents in index {name!r}?", abort=True)
    submitted: list[dict[str, Any]] = []
    with _expected_errors(), gateway() as client, _interruptible(submitted):
        job = _submit_delete(client, "DELETE", f"/v1/indexes/{segment(name)}")
        submitted.append(job)
        job = _finish(client, job)
        voided = _check_found(client, name, [job])
    _report(console, job, f"from index {name}", json_out, voided)


def document_pages(
    client: Gateway, index: str, page_size: int
) -> Iterator[tuple[list[dict[str, Any]], str | None]]:
    """Each page of ``GET /v1/indexes/{index}/documents`` from the first, with its
    ``next_page_token``, following the tokens to the end; a page that meets a transient
    failure (a 503, a gateway restarting) is read again (``Gateway.pages``): ``--all``
    stopped at the first, every page read before it lost."""
    path = f"/v1/indexes/{segment(index)}/documents"
    for page in client.pages(path, {"page_size": page_size}, "documents"):
        yield page["documents"], page.get("next_page_token")


def fetch_documents(
    client: Gateway, index: str, limit: int | None, on_page: Callable[[int], object] | None = None
) -> tuple[list[dict[str, Any]], bool]:
    """The first ``limit`` of the index's documents by id (all of them: None), page after
    page of ``GET /v1/indexes/{index}/documents``, and whether more are left; ``on_page`` is
    called with each page's count."""
    docs: list[dict[str, Any]] = []
    left = False  # the last page read has a next_page_token
    size = min(limit or MAX_PAGE_SIZE, MAX_PAGE_SIZE)
    for page, token in document_pages(client, index, size):
        docs += page
        left = bool(token)
        if on_page is not None:
            on_page(len(page))
        if limit is not None and len(docs) >= limit:
            break
    if limit is None:
        return docs, False
    return docs[:limit], left or len(docs) > limit


def _echo_json_array(
    pages: Iterable[tuple[list[dict[str, Any]], str | None]], on_page: Callable[[int], object]
) -> None:
    """The documents as one JSON array (what ``json.dumps`` of the list writes), each page
    written as it comes: ``--all`` holds one page, not the index (a million documents held
    as dicts are about a GB). A failure half-way leaves the array unterminated (and exit 1),
    so what was written cannot pass for the whole list."""
    sep = ""
    typer.echo("[", nl=False)
    for page, _token in pages:
        for doc in page:
            typer.echo(sep + json.dumps(doc, ensure_ascii=False), nl=False)
            sep = ", "
        on_page(len(page))
    typer.echo("]")


def _preview(doc: dict[str, Any]) -> str:
    """The start of the text on one line, "…" when there is more of it."""
    raw = str(doc.get("text_preview", ""))
    text = " ".join(raw.split())
    cut = len(text) > PREVIEW_SHOWN or int(doc.get("text_length", 0)) > len(raw)
    return plain(text[:PREVIEW_SHOWN] + ("…" if cut else ""))


def _print_documents(
    console: Console, index: str, docs: list[dict[str, Any]], total: int, more: bool
) -> None:
    columns = ["id", "title", "revision", "version", "chars", "metadata", "text"]
    rows = [
        [
            plain(d["id"]),
            plain(d.get("title") or "–"),
            plain(d.get("revision") or "–"),
            "–" if d.get("version") is None else str(d["version"]),
            f"{int(d.get('text_length', 0)):,}",
            plain(json.dumps(d["metadata"], ensure_ascii=False)) if d.get("metadata") else "–",
            _preview(d),
        ]
        for d in docs
    ]
    print_fitted(
        console,
        f"{counted(len(docs), 'document', 'documents')} of {total:,} in {plain(index)}, by id",
        columns,
        rows,
        drop_order=["revision", "version", "chars", "metadata", "title"],
        wrapped=("title", "metadata", "text"),
        right=("version", "chars"),
    )
    if more:
        console.print("[dim]more documents follow: --limit N shows more, --all shows every one[/]")


@documents_app.command("list")
def documents_list(
    index: IndexArgument,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", min=1, help=f"show the first N by id (default {DEFAULT_DOCUMENTS_SHOWN})"
        ),
    ] = None,
    every: Annotated[
        bool, typer.Option("--all", help="every document, page after page, with a progress bar")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="print the documents as a JSON array")
    ] = False,
) -> None:
    """List your documents in an index by id: title, revision, version, length, metadata and
    the start of the text (never the vector)."""
    console = _out()
    with _expected_errors():
        if every and limit is not None:
            raise typer.BadParameter("give one of them", param_hint="'--limit' / '--all'")
        with gateway() as client:
            shown = client.json(
                "GET", f"/v1/indexes/{segment(index)}", fields=INDEX_FIELDS, retry_for=RETRY_SECONDS
            )
            total = int(shown["documents"])
            if every:
                with progress_bar() as progress:
                    task = progress.add_task(f"list {index}", total=total)

                    def advance(n: int) -> None:
                        progress.advance(task, n)

                    if json_out:
                        _echo_json_array(document_pages(client, index, MAX_PAGE_SIZE), advance)
                        return
                    docs, more = fetch_documents(client, index, None, advance)
            else:
                docs, more = fetch_documents(client, index, limit or DEFAULT_DOCUMENTS_SHOWN)
    if json_out:
        typer.echo(json.dumps(docs, ensure_ascii=False))
    else:
        _print_documents(console, index, docs, total, more)


@documents_app.command("get")
def documents_get(
    doc_id: Annotated[str, typer.Argument(callback=utf8_text, help="the document id")],
    index: IndexOption,
    json_out: JsonOut = False,
) -> None:
    """Print one document as stored (text, title, metadata, revision)."""
    console = _out()
    with _expected_errors(), gateway() as client:
        doc = client.json(
            "GET",
            f"/v1/indexes/{segment(index)}/documents/{segment(doc_id)}",
            fields=("id", "text"),
            retry_for=RETRY_SECONDS,
        )
    if json_out:
        _print_json(console, doc)
        return
    console.print(
        f"[bold]{plain(doc['id'])}[/]  revision {plain(doc['revision'])}  "
        f"version {doc.get('version')}"
    )
    if doc.get("title"):
        console.print(f"[bold]{plain(doc['title'])}[/]")
    if doc.get("metadata"):
        console.print(f"metadata: {plain(json.dumps(doc['metadata'], ensure_ascii=False))}")
    console.print(plain(doc["text"], lines=True), soft_wrap=True)  # its own lines kept


@documents_app.command("delete")
def documents_delete(
    doc_ids: Annotated[list[str], typer.Argument(callback=utf8_text, help="the document ids")],
    index: IndexOption,
    json_out: JsonOut = False,
) -> None:
    """Delete documents by id (one job per 1,000 ids) and wait until they are gone."""
    console = _out()
    doc_ids = list(dict.fromkeys(doc_ids))  # an id given again past 1,000 made its own job
    jobs: list[dict[str, Any]] = []
    submitted: list[dict[str, Any]] = []
    with _expected_errors(), gateway() as client, _interruptible(submitted):
        for start in range(0, len(doc_ids), MAX_DOCUMENTS_PER_REQUEST):
            chunk = doc_ids[start : start + MAX_DOCUMENTS_PER_REQUEST]
            job = _submit_delete(
                client, "POST", f"/v1/indexes/{segment(index)}/documents/delete",
                json={"ids": chunk},
            )  # fmt: skip
            submitted.append(job)
            jobs.append(_finish(client, job))
        voided = _check_found(client, index, jobs)
    _report(console, deletes_summary(jobs), f"from index {index}", json_out, voided)


def deletes_summary(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """``sift documents delete``'s answer, one shape however many jobs its ids took (one per
    1,000: its ``--json`` was the one job's answer up to 1,000 ids, this past them): the
    documents deleted, ``succeeded`` unless a job was not (then its status and error), and
    every job's answer.

    >>> deletes_summary([{"id": "i1", "status": "succeeded", "deleted": 2}])["deleted"]
    2
    """
    failed = next((j for j in jobs if j.get("status") != "succeeded"), None)
    return {
        "status": "succeeded" if failed is None else failed.get("status"),
        "deleted": sum(j.get("deleted") or 0 for j in jobs),
        "error": None if failed is None else failed.get("error"),
        "jobs": jobs,
    }
