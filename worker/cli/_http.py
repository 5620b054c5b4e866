"""The CLI's one HTTP client for the gateway: auth header, error messages, and polling."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx
import typer
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from worker.cli._common import cli_settings
from worker.constants import (
    ERROR_JOB_STORE_FULL,
    ERROR_STARTING,
    ERROR_TENANT_REMOVED,
    IDEMPOTENCY_PENDING_TTL_SECONDS,
)
from worker.contract import INDEX_PATTERN
from worker.core.budget import answer_date, retry_after_seconds

FINAL_STATUSES = frozenset({"succeeded", "failed", "canceled"})
USER_AGENT = "sift-cli/1"
# A gateway restarting (no connection, or one closed with no answer), Redis restarting (503),
# a proxy's 502 or 504: a request that may retry does so for this long. `sift batch` stopped
# at its first such poll while its batch ran on, and a submit whose answer was lost left the
# user to send the batch again, and pay for it twice.
RETRY_SECONDS = 120.0
TRANSIENT_STATUSES = frozenset({502, 503, 504})
# A ``Retry-After`` (the gateway's 503 says 1 s; a proxy's 429 its own) is waited out, up to
# this: a longer one is waited no longer than this before the next try.
MAX_RETRY_AFTER_SECONDS = 30.0
MAX_INDEX_CHARS = 128  # the gateway's IndexName
# The 503 types of a gateway that stored nothing: its Redis full, or the gateway still starting
NOTHING_STORED = frozenset({ERROR_JOB_STORE_FULL, ERROR_STARTING})


def submit_retry_seconds() -> float:
    """How long a submission with an ``Idempotency-Key`` (an upsert, a delete, a search, a
    batch) is sent again: ``RETRY_SECONDS``, and past them the life of a key's claim. A send
    whose gateway died between claiming the key and making the job leaves the key ``409
    idempotency_key_in_progress`` for ``IDEMPOTENCY_PENDING_TTL_SECONDS`` from that claim,
    which may come late in the window: the resends outwait it, and then make the job."""
    return RETRY_SECONDS + IDEMPOTENCY_PENDING_TTL_SECONDS


def index_name(value: str | None) -> str | None:
    """A typer callback: ``value`` if the gateway takes it as an index name, else a usage error
    naming the option (the gateway routes on the decoded path, so a name such as
    ``docs/documents/d1`` reached another route: ``sift index delete`` deleted a document).
    ``fullmatch``: the pattern's ``$`` also matches before a last line break."""
    if value is not None and (
        len(value) > MAX_INDEX_CHARS or not re.fullmatch(INDEX_PATTERN, value)
    ):
        raise typer.BadParameter(
            f"{value!r} is not an index name: lowercase letters, digits, '_', '.' and '-', "
            f"starting with a letter or digit, up to {MAX_INDEX_CHARS} characters"
        )
    return value


def utf8_text(value: str | list[str] | None) -> str | list[str] | None:
    """A typer callback: ``value`` (a text, or each of a list) if UTF-8 can encode it, else a
    usage error naming the argument. A command line's byte that is no UTF-8 reaches Python as
    a lone surrogate (``sift search $'\\xff'``), which would stop the command on a traceback
    where its request is built."""
    for text in [value] if isinstance(value, str) else value or []:
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise typer.BadParameter(
                f"{text!r} is not UTF-8 text (a byte that is no UTF-8 at character {exc.start})"
            ) from None
    return value


def segment(text: str) -> str:
    """``text`` (an index name, a document id) as one segment of a request's path: every
    ``/`` percent-encoded, and so is a ``.`` or ``..`` segment, which the HTTP client would
    otherwise resolve (``documents/..`` is the index itself).

    >>> segment("a/b c"), segment(".."), segment("v1.2")
    ('a%2Fb%20c', '%2E%2E', 'v1.2')
    """
    quoted = quote(text, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


class GatewayError(Exception):
    """An expected failure talking to the gateway, worded for the user (no traceback).
    ``transient``: the same request may succeed when sent again, after ``retry_after``
    seconds when the answer said so. ``unsent``: it never reached the gateway (no
    connection was made), so it did nothing there. ``refused``: the gateway answered that
    it stored nothing (``503 job_store_full``, or ``starting``: ``sift gateway`` still waits
    for its Redis), so it did nothing there either."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        transient: bool = False,
        retry_after: float | None = None,
        unsent: bool = False,
        refused: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.transient = transient
        self.retry_after = retry_after
        self.unsent = unsent
        self.refused = refused

    @property
    def unapplied(self) -> bool:
        """Whether the request provably did nothing at the gateway: never sent, or refused
        with nothing stored."""
        return self.unsent or self.refused


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, GatewayError) and exc.transient


_backoff = wait_exponential(multiplier=0.25, max=5.0)


def _wait(state: RetryCallState) -> float:
    """The backoff's wait, or the answer's ``Retry-After`` when that is longer."""
    exc = state.outcome.exception() if state.outcome is not None else None
    told = exc.retry_after if isinstance(exc, GatewayError) else None
    return max(_backoff(state), told or 0.0)


def _retry_after(response: httpx.Response) -> float | None:
    """The answer's ``Retry-After`` in seconds, as delay-seconds or an HTTP-date (a proxy's
    or load balancer's may be either: a date was taken for none, and the backoff's quarter
    second applied), up to ``MAX_RETRY_AFTER_SECONDS``. A date is on the answering host's
    clock, and read against the answer's own ``Date`` (this machine's clock without one)."""
    date = answer_date(response.headers.get("date"))
    seconds = retry_after_seconds(response.headers.get("retry-after"), date)
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER_SECONDS)


def _say_retrying(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    said = str(exc).rstrip(".")  # "...`sift up`.; trying again" read as a typo
    sys.stderr.write(f"{said}; trying again\n")


def _field_of(loc: Any) -> str:
    parts = [str(p) for p in loc] if isinstance(loc, list | tuple) else [str(loc)]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts)


def _error_member(response: httpx.Response, name: str) -> object:
    """The member ``name`` (``field``, ``type``) of the gateway's ``{"error": {...}}``
    answer, or None."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get(name) if isinstance(error, dict) else None


def describe_error(response: httpx.Response) -> str:
    """A one-paragraph message for a 4xx/5xx answer, naming the field when the gateway does."""
    prefix = f"the gateway answered {response.status_code}"
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()[:300]
        return f"{prefix}: {text}" if text else prefix
    problems: list[str] = []
    if isinstance(body, dict):
        detail = body.get("detail")
        error = body.get("error")
        if isinstance(detail, list):  # FastAPI's validation shape
            for item in detail:
                if isinstance(item, dict):
                    field = _field_of(item.get("loc", []))
                    msg = str(item.get("msg", item))
                    problems.append(f"{field}: {msg}" if field else msg)
        elif isinstance(detail, str):
            problems.append(detail)
        elif isinstance(detail, dict):
            error = detail
        if isinstance(error, dict):
            name = error.get("field")
            msg = str(error.get("message") or error.get("type") or error)
            problems.append(msg if not name or msg.startswith(f"{name}:") else f"{name}: {msg}")
        elif isinstance(error, str):
            problems.append(error)
        if not problems and "message" in body:
            problems.append(str(body["message"]))
    if not problems:
        problems.append(str(body)[:300])
    return f"{prefix}: " + "; ".join(problems)


def _in_progress(response: httpx.Response) -> bool:
    """A 409 saying the same Idempotency-Key's first request is still being written."""
    if response.status_code != 409:
        return False
    try:
        return bool(response.json()["error"]["type"] == "idempotency_key_in_progress")
    except (ValueError, KeyError, TypeError):
        return False


def json_size(body: Any) -> int:
    """The bytes of ``body`` sent as a request's JSON, encoded as httpx encodes it."""
    return len(httpx.Request("POST", "http://sift.invalid/", json=body).content)


class Gateway:
    """The gateway at ``base_url``, with the bearer key on every request.

    ``max_body_bytes``: the largest request body it takes (``SIFT_MAX_BODY_BYTES`` as this
    command reads it: the gateway's default unless set here too); a command checks a large
    body against it before sending it, and a gateway set lower still answers ``413``."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_body_bytes = max_body_bytes
        self.has_key = bool(api_key)
        # a gateway that has never answered this client is not running, not restarting:
        # a refused connection is then told at once rather than retried for minutes
        self._answered = False
        headers = {"user-agent": USER_AGENT}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
            transport=transport,
            follow_redirects=False,
        )

    def close(self) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        retry_for: float = 0.0,
    ) -> httpx.Response:
        """Send one request; a 4xx/5xx or a network failure becomes a GatewayError. With
        ``retry_for``, a transient failure is sent again, backing off, for that many seconds
        (only for a request that is safe to repeat: a GET, a merge patch, or a submission
        with an Idempotency-Key)."""
        if retry_for <= 0:
            return self._send(method, path, json=json, params=params, headers=headers)
        retrying = Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_delay(retry_for),
            wait=_wait,
            before_sleep=_say_retrying,
            reraise=True,
        )
        response: httpx.Response = retrying(
            self._send, method, path, json=json, params=params, headers=headers
        )
        return response

    def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any,
        params: dict[str, Any] | None,
        headers: dict[str, str] | None,
    ) -> httpx.Response:
        try:
            response = self._client.request(method, path, json=json, params=params, headers=headers)
        except httpx.ConnectError as exc:
            raise GatewayError(
                f"cannot connect to the gateway at {self.base_url} (SIFT_URL); "
                "is it running? Start one with `sift up`",  # no period: messages go on after
                transient=self._answered,
                unsent=True,
            ) from exc
        except httpx.TimeoutException as exc:
            unsent = isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
            raise GatewayError(
                f"the gateway at {self.base_url} (SIFT_URL) did not answer in time",
                transient=True,
                unsent=unsent,
            ) from exc
        except httpx.HTTPError as exc:
            raise GatewayError(
                f"talking to {self.base_url} (SIFT_URL) failed: {exc}",
                transient=isinstance(exc, httpx.TransportError),
            ) from exc
        self._answered = True
        if response.status_code == 401:
            hint = "check SIFT_API_KEY" if self.has_key else "SIFT_API_KEY is not set"
            raise GatewayError(f"{describe_error(response)} ({hint})", status_code=401)
        if response.status_code == 403 and _error_member(response, "field") == "Authorization":
            # a key the gateway does not know: SIFT_API_KEY holds it
            raise GatewayError(f"{describe_error(response)} (check SIFT_API_KEY)", status_code=403)
        if response.status_code >= 400:
            code = response.status_code
            # a 429 to a read (a proxy's rate limit) passes; one to a submit is the backlog
            # full, which the user is told of (the gateway says when to send it again)
            limited = code == 429 and method == "GET"
            # a removed tenant's 503 lasts until its gateway restarts without the key
            lasting = _error_member(response, "type") == ERROR_TENANT_REMOVED
            raise GatewayError(
                describe_error(response),
                status_code=code,
                transient=(code in TRANSIENT_STATUSES and not lasting)
                or limited
                or _in_progress(response),
                retry_after=_retry_after(response),
                refused=code == 503 and _error_member(response, "type") in NOTHING_STORED,
            )
        return response

    def json(
        self, method: str, path: str, *, fields: tuple[str, ...] | None = None, **kwargs: Any
    ) -> Any:
        """The answer to ``method path``, parsed; with ``fields``, an object holding each of
        them, else a GatewayError (:func:`sift_answer`)."""
        body = json_of(self.request(method, path, **kwargs), method, path)
        return body if fields is None else sift_answer(body, method, path, fields)

    def pages(
        self, path: str, params: dict[str, Any], key: str, *, retry_for: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Each page of the list at ``path`` (a GET with ``params``), from the first, following
        its ``next_page_token`` to the end; a caller that stops early sends no more requests.
        A page read is a GET: one that meets a transient failure is sent again for up to
        ``retry_for`` seconds (``RETRY_SECONDS`` by default), so a 503 half-way does not lose
        the pages read before it. Each page holds its entries as a list under ``key``, else it
        is no Sift gateway's (:func:`sift_answer`).

            for page in client.pages("/v1/indexes", {"page_size": 1000}, "indexes"):
                names += [index["name"] for index in page["indexes"]]
        """
        params = dict(params)
        window = RETRY_SECONDS if retry_for is None else retry_for
        while True:
            page = self.json("GET", path, params=params, retry_for=window, fields=(key,))
            if not isinstance(page[key], list):
                raise not_sift("GET", path)
            yield page
            token = page.get("next_page_token")
            if not token:
                return
            params["page_token"] = token

    def update_index(self, index: str, body: dict[str, Any]) -> dict[str, Any]:
        """``PATCH /v1/indexes/{index}``: change the index's own search settings (a merge
        patch: a field left out stays, ``None`` clears it); answers the index's metadata,
        whose ``settings`` show what is now stored. Sent again through a transient failure:
        the same values set twice are set once."""
        found: dict[str, Any] = self.json(
            "PATCH", f"/v1/indexes/{segment(index)}", json=body, fields=("name", "settings"),
            retry_for=RETRY_SECONDS,  # the same merge patch sent again sets the same
        )  # fmt: skip
        return found

    def poll(
        self,
        path: str,
        *,
        done: Callable[[dict[str, Any]], bool] | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        interval: float = 0.2,
        max_interval: float = 2.0,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """GET ``path`` until ``done`` (by default: a final ``status``), backing off to 2 s."""
        is_done = done or (lambda body: body.get("status") in FINAL_STATUSES)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            body: dict[str, Any] = self.json(
                "GET", path, retry_for=RETRY_SECONDS, fields=("id", "status")
            )
            if on_update is not None:
                on_update(body)
            if is_done(body):
                return body
            if deadline is not None and time.monotonic() > deadline:
                raise GatewayError(f"GET {path}: still {body.get('status')} after {timeout} s")
            time.sleep(interval)
            interval = min(interval * 1.5, max_interval)


def json_of(response: httpx.Response, method: str, path: str) -> Any:
    """The body of the gateway's answer to ``method path``, parsed; a GatewayError if it is
    not JSON."""
    try:
        return response.json()
    except ValueError as exc:
        raise GatewayError(f"{method} {path}: the gateway's answer is not JSON") from exc


def not_sift(method: str, path: str) -> GatewayError:
    return GatewayError(
        f"{method} {path}: the answer is not a Sift gateway answer (SIFT_URL): is SIFT_URL "
        "another service's address?"
    )


def sift_answer(body: Any, method: str, path: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """``body`` if it is an object holding each of ``fields``, else a GatewayError naming
    SIFT_URL. A URL that answers 200 with another app's JSON (another service on the port, a
    proxy's catch-all) made tracebacks (``KeyError: 'indexes'``) or, read with ``.get``, an
    empty list that passed for the truth; every answer read is checked here.

    >>> sift_answer({"id": "s1", "status": "queued"}, "GET", "/v1/searches/s1", ("id",))
    {'id': 's1', 'status': 'queued'}
    """
    if isinstance(body, dict) and all(field in body for field in fields):
        return body
    raise not_sift(method, path)


@contextmanager
def gateway(transport: httpx.BaseTransport | None = None) -> Iterator[Gateway]:
    """The gateway of ``SIFT_URL``, with the key of ``SIFT_API_KEY`` (a bad setting: exit 2)."""
    settings = cli_settings()
    client = Gateway(
        settings.url, settings.api_key, transport=transport, max_body_bytes=settings.max_body_bytes
    )
    try:
        yield client
    finally:
        client.close()
