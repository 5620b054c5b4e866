"""Page tokens: a batch's results offset and the listings' cursors, each tied by a digest to
the list it was made for, so another list's token or an edited one is a 422 naming
``page_token``."""

from __future__ import annotations

import base64
import binascii
import hashlib

from worker.constants import MAX_BATCH_QUERIES
from worker.errors import InvalidRequest

TOKEN_DIGEST_BYTES = 8
NOT_OURS = "is not a token this list issued"


def encode_results_token(batch_id: str, offset: int) -> str:
    """The page token of a batch's results: the offset, and a digest that ties it to the
    batch (the digest is no secret: it only catches mix-ups and edits).

    >>> batch = "bat_" + "0" * 32
    >>> decode_results_token(encode_results_token(batch, 2), batch)
    2
    """
    return pack_token("r", token_digest(batch_id, str(offset)), str(offset))


def decode_results_token(token: str | None, batch_id: str) -> int:
    """The offset in a page token of ``batch_id``'s results (0 for none). Only the exact text
    :func:`encode_results_token` made for this batch is one: another batch's token (a bare
    offset was, and read this batch from there), a list's, or an edited one is a 422 naming
    ``page_token`` before Redis sees it, as the lists answer theirs."""
    parts = unpack_token(token, 3)
    if parts is None:
        return 0
    kind, _, value = parts
    offset = int(value) if value.isascii() and value.isdigit() else -1
    if (
        kind != "r"
        or not 0 <= offset <= MAX_BATCH_QUERIES
        or encode_results_token(batch_id, offset) != token
    ):
        raise InvalidRequest("page_token", NOT_OURS)
    return offset


def token_digest(*fields: str) -> str:
    """What ties a page token to the list it was made for: a short digest of ``fields`` (no
    secret: it only catches mix-ups and edits)."""
    key = "\0".join(fields).encode()
    return hashlib.blake2b(key, digest_size=TOKEN_DIGEST_BYTES).hexdigest()


def max_cursor_chars(last_bytes: int) -> int:
    """The longest token :func:`encode_cursor` makes of a ``last`` of up to ``last_bytes``
    bytes ("k:<digest hex>:<last>" in unpadded base64)."""
    return 4 * -(-(3 + 2 * TOKEN_DIGEST_BYTES + last_bytes) // 3)


def encode_cursor(kind: str, scope: tuple[str, ...], last: str) -> str:
    """A listing's page token: its ``kind`` (one letter per listing), the last entry listed
    (a name, an id, a job's place), and a digest that ties it to ``scope`` (the listing it was
    made for: the tenant, and the index or list).

    >>> token = encode_cursor("i", ("i", "acme"), "docs")
    >>> decode_cursor(token, "i", ("i", "acme"), 128)
    'docs'
    >>> decode_cursor(token, "i", ("i", "bob"), 128)
    Traceback (most recent call last):
    worker.errors.InvalidRequest: page_token: is not a token this list issued
    """
    return pack_token(kind, token_digest(*scope, last), last)


def decode_cursor(token: str | None, kind: str, scope: tuple[str, ...], longest: int) -> str | None:
    """What ``token`` starts the page after (None: the first page). Only the exact text
    :func:`encode_cursor` made for this kind and scope is one; anything else (another
    tenant's, another listing's, an offset token a list gave before, an edited one) is a
    422 naming ``page_token``, which says nothing of what the token held. The digest is no
    secret (it only catches edits and mix-ups): a forged token starts the caller's own list
    somewhere, and shows nothing more than a page the caller may read anyway."""
    parts = unpack_token(token, 3)
    if parts is None:
        return None
    got, _, last = parts
    if got != kind or not 1 <= len(last) <= longest or encode_cursor(kind, scope, last) != token:
        raise InvalidRequest("page_token", NOT_OURS)
    return last


def pack_token(*fields: str) -> str:
    """A page token: ``fields`` joined by ``:``, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(":".join(fields).encode()).decode().rstrip("=")


def unpack_token(token: str | None, fields: int) -> list[str] | None:
    """The ``fields`` of a page token :func:`pack_token` made (the last may hold ``:``);
    ``None`` for no token, a 422 naming ``page_token`` for an empty one or one not made so.
    Each list then checks its fields, and that packing them again gives the token exactly."""
    if token is None:
        return None
    if not token:
        raise InvalidRequest("page_token", "is empty: leave it out for the first page")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidRequest("page_token", NOT_OURS) from exc
    parts = raw.split(":", fields - 1)
    if len(parts) != fields:
        raise InvalidRequest("page_token", NOT_OURS)
    return parts
