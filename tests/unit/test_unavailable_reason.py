"""What ``/readyz`` (which answers anyone) and the gateway's log say of a Redis failure: the
log says why, naming the setting; ``/readyz`` gives the reasons that quote nothing of Redis
(unanswered in time, unreachable) as the log does, and every refusal in words of its own.
The app is a stand-in holding only what the reasons read: the timeout setting and whether
``SIFT_REDIS_URL`` gives a password."""

from __future__ import annotations

import ssl
from types import SimpleNamespace
from typing import cast

import pytest
import redis
from fastapi import FastAPI

from api_gateway.errors import UNREACHABLE, public_unavailable_reason, unavailable_reason

REFUSED = "Redis refused the gateway (its log says why)"


def _app(password: str | None) -> FastAPI:
    pool = SimpleNamespace(connection_kwargs={"password": password})
    state = SimpleNamespace(
        settings=SimpleNamespace(gateway_redis_timeout_seconds=2.5),
        store=SimpleNamespace(redis=SimpleNamespace(connection_pool=pool)),
    )
    return cast(FastAPI, SimpleNamespace(state=state))


def _tls_refused() -> redis.ConnectionError:
    """As redis-py raises it from the ``ssl`` module's error, whose ``reason`` and
    ``verify_message`` the ``ssl`` module sets."""
    cause = ssl.SSLCertVerificationError(1, "certificate verify failed")
    cause.reason = "CERTIFICATE_VERIFY_FAILED"
    cause.verify_message = "self-signed certificate"
    exc = redis.ConnectionError("Error 1 connecting to redis:6380")
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize(
    ("exc", "password", "logged"),
    [
        (redis.TimeoutError("Timeout reading from socket"), "pw",
         "Redis did not answer within 2.5 s (SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS)"),
        (redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379"), "pw", UNREACHABLE),
    ],
    ids=["timeout", "unreachable"],
)  # fmt: skip
def test_readyz_says_what_the_log_says_of_a_redis_that_refused_nothing(
    exc: Exception, password: str | None, logged: str
) -> None:
    app = _app(password)
    assert unavailable_reason(app, exc) == logged
    assert public_unavailable_reason(app, exc) == logged


@pytest.mark.parametrize(
    ("exc", "password", "logged"),
    [
        (redis.ResponseError("DB index is out of range"), "pw", "no such database"),
        (redis.AuthenticationError("WRONGPASS invalid username-password pair"), "pw",
         "WRONGPASS invalid username-password pair"),
        (redis.AuthenticationError("NOAUTH Authentication required."), None,
         "SIFT_REDIS_URL gives none"),
        (redis.exceptions.NoPermissionError("this user has no permissions to run 'ping'"), "pw",
         "NOPERM this user has no permissions to run 'ping'"),
        (_tls_refused(), "pw", "CERTIFICATE_VERIFY_FAILED: self-signed certificate"),
    ],
    ids=["database", "credentials", "no-password", "acl", "tls"],
)  # fmt: skip
def test_readyz_words_a_refusal_of_its_own_and_the_log_says_why(
    exc: Exception, password: str | None, logged: str
) -> None:
    app = _app(password)
    assert logged in unavailable_reason(app, exc)
    assert public_unavailable_reason(app, exc) == REFUSED
