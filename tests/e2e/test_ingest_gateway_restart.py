"""``sift ingest`` through a gateway that restarts under it (stopped, then started again on
the same port a few seconds later), run as a user runs it: its own process, the stack's
Redis and worker behind a gateway of its own.

Before, its document POST was sent once: the first request the gateway missed stopped the
command, "cannot connect to the gateway", exit 1, while ``sift batch`` and ``sift eval``
waited for it. An ingest is safe to send again (documents are replaced by id, each write
versioned), so its POST now retries through the restart for the same window as theirs.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

from tests.e2e.conftest import KEYS, Stack
from tests.e2e.test_ingest_interrupt import _corpus, _indexed, sift_ingest
from tests.services import free_port, gateway

DOWN_SECONDS = 3.0


def test_sift_ingest_retries_its_requests_through_a_gateway_restart(
    stack: Stack, tmp_path: Path
) -> None:
    corpus, ids = _corpus(tmp_path, 300)
    index = "cli-restarted"
    env = {"SIFT_API_KEYS": json.dumps(KEYS), "SIFT_REDIS_URL": stack.redis_url + "/0"}
    port = free_port()
    with ExitStack() as first:
        url = first.enter_context(gateway(tmp_path / "g", env, "first", port=port))
        with sift_ingest(url, corpus, index, "--batch-size", "2") as sift:
            sift.until(lambda: len(_indexed(stack, index)) >= 10, "ten documents indexed")
            first.close()  # the gateway stopped, mid-ingest
            time.sleep(DOWN_SECONDS)
            assert sift.proc.poll() is None, sift.stderr()  # still trying, not given up
            with gateway(tmp_path / "g", env, "second", port=port):
                code = sift.finish(seconds=120)
                err = sift.stderr()
    assert code == 0, err
    assert "trying again" in err, err  # the retries are said, as sift batch says them
    assert ".; trying again" not in err, err  # "...`sift up`.; trying again" read as a typo
    assert _indexed(stack, index) == set(ids)
