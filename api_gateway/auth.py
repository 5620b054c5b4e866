"""API key authentication: a Bearer key decides the tenant; keys kept as SHA-256 digests."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers

from api_gateway.errors import ApiError
from worker.settings import ApiKey

bearer = HTTPBearer(auto_error=False, description="An API key; it decides the tenant.")


class KeyRing:
    """Maps a presented key to its tenant in constant time, holding no plaintext key.

    ring = KeyRing([ApiKey(key="dev-key-123", tenant="acme", webhook_secret="whsec_...")])
    ring.tenant_for("dev-key-123")  # "acme"; an entry may give key_sha256 instead of key
    """

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        # the keys as Settings.all_api_keys gives them: checked there (one tenant a key, one
        # webhook secret a tenant), where the workers read them too
        self._entries = [(k.digest(), k.tenant) for k in keys]

    def __len__(self) -> int:
        return len(self._entries)

    def tenant_for(self, presented: str) -> str | None:
        digest = hashlib.sha256(presented.encode()).digest()
        tenant: str | None = None
        for known, owner in self._entries:  # no early exit: the time does not say which key
            if hmac.compare_digest(known, digest):
                tenant = owner
        return tenant


def _unauthenticated(message: str) -> ApiError:
    return ApiError(
        401,
        "unauthenticated",
        message,
        field="Authorization",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _one_authorization(request: Request) -> None:
    """401 for a request with two ``Authorization`` headers: one was read and the other
    ignored, so what the request was let in as depended on the headers' order."""
    times = len(request.headers.getlist("authorization"))
    if times > 1:
        raise _unauthenticated(f"Authorization: is given {times} times: give one key")


async def authenticate(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
) -> str:
    """The caller's tenant. 401 without a Bearer key, or with two (one was used and the
    other ignored: the tenant depended on the headers' order); 403 for a key not known."""
    _one_authorization(request)
    if credentials is None or not credentials.credentials:
        raise _unauthenticated("Authorization: a Bearer API key is required")
    ring: KeyRing = request.app.state.keyring
    tenant = ring.tenant_for(credentials.credentials)
    if tenant is None:
        raise ApiError(
            403, "forbidden", "Authorization: the API key is not valid", field="Authorization"
        )
    return tenant


def key_refused(headers: Headers, ring: KeyRing) -> bool:
    """Whether :func:`authenticate` refuses a request with these ``headers`` (its 401 or 403):
    no ``Authorization``, two, one that is no Bearer key (read as ``HTTPBearer`` reads it), or
    a key the ``ring`` does not know. :class:`api_gateway.middleware.BodyLimitMiddleware` asks
    it before it keeps a body."""
    values = headers.getlist("authorization")
    if len(values) != 1:
        return True
    scheme, credentials = get_authorization_scheme_param(values[0])
    return scheme.lower() != "bearer" or not credentials or ring.tenant_for(credentials) is None


def require_metrics_token(request: Request, token: str | None) -> None:
    """``/metrics`` is the operator's: fleet-wide traffic, backlog and spend, which no tenant
    should read. With ``SIFT_METRICS_TOKEN`` set only that Bearer token reads it (401
    otherwise, whatever API key is shown); unset, it is open."""
    if token is None:
        return
    _one_authorization(request)
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode(), token.encode()
    ):
        raise _unauthenticated("Authorization: /metrics needs the Bearer SIFT_METRICS_TOKEN")
