"""A request the key check refuses keeps no body in the gateway's memory.

The gateway reads a request's body before routing it (the 413 and 415 are answered as it
arrives), and kept it whole until the route's key check answered 401 or 403: ten callers with
no key, each sending 32 MB at once, took one gateway past 500 MB, the memory limit of
deploy/k8s's gateway pod. Now such a body is read and dropped as it arrives.

Measured on a real ``sift gateway`` process: its peak resident memory (``VmHWM``, reset
through ``/proc/<pid>/clear_refs``) while it answers one such request. The control, the same
body with a valid key, is kept (it is read, then refused as a 422), and the peak grows by it,
by under four times its size.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.keys import ACME, ACME_KEY
from tests.services import redis_server
from worker.processes.stack import child_env, gateway_service, running

TEXT_CHARS = 30_000_000  # a body under the default 32 MiB limit
MiB = 2**20


def _peak_growth(pid: int, send: httpx.Client, headers: dict[str, str]) -> tuple[int, int]:
    """The status of one ingest of a ``TEXT_CHARS`` text sent with ``headers``, and by how
    many bytes the gateway's peak resident memory grew while it answered."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak, back to what is held now
    before = _status_kb(pid, "VmHWM")
    body = json.dumps({"documents": [{"id": "a", "text": "x" * TEXT_CHARS}]})
    response = send.post(
        "/v1/indexes/docs/documents",
        content=body,
        headers={"Content-Type": "application/json", **headers},
    )
    return response.status_code, (_status_kb(pid, "VmHWM") - before) * 1024


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.timeout(120)
def test_a_body_the_key_check_refuses_is_not_kept_in_memory(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_API_KEYS": json.dumps([ACME_KEY])}
        service, base = gateway_service(tmp_path / "g", child_env(env, inherit_sift=False))
        with running(service), httpx.Client(base_url=base, timeout=60) as client:
            assert service.proc is not None
            pid = service.proc.pid
            for headers, refused in [({}, 401), ({"Authorization": "Bearer not-a-key"}, 403)]:
                status, grown = _peak_growth(pid, client, headers)
                assert status == refused, status
                assert grown < 8 * MiB, f"{grown / MiB:.0f} MiB held for a refused body"
            status, grown = _peak_growth(pid, client, ACME)  # the control: a key, kept
            assert status == 422, status  # the text is past 100,000 characters
            assert grown > TEXT_CHARS, f"only {grown / MiB:.0f} MiB for a kept body"
            # held at once: the body, its decoded text and the parsed value (3 copies, 86
            # MiB); it was 143 MiB, 5 copies: the pieces the body came in, kept until joined,
            # and the joined body beside Starlette's own copy
            assert grown < 4 * TEXT_CHARS, f"{grown / MiB:.0f} MiB held for a kept body"
