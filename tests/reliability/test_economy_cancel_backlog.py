"""An economy batch's cancel behind another batch's backlog, at default settings (the stack
of :mod:`tests.reliability.economy`).

``DELETE /v1/batches/{id}`` of an economy batch sends ``sift.economy_cancel``, which cancels
its provider batches: the requests the provider has not processed by then come back
``canceled``, unbilled. It went on the batch queue, first in, first out, behind every chunk
of the batches submitted before the cancel, whoever sent them: a 100,000-query batch ahead
put the provider's cancel off for minutes, while the provider went on processing (and
billing) the requests the client had canceled, and a provider batch that ended meanwhile
turned the cancel into a batch ``succeeded``. The cancel is a few calls to the provider,
not a batch's work: it goes on the search queue, which never waits behind a batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.economy import economy_stack, finished, submit_economy, worker
from tests.reliability.support import ACME, batch_counts, ingest, submit_batch, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL_SECONDS = 25.0  # each standard rerank: under the search deadline (30 s), the backlog slow
BACKLOG = 6_000  # standard items queued ahead of the cancel: 240 chunks


def test_an_economy_cancel_reaches_the_provider_ahead_of_another_batch_s_backlog(
    tmp_path: Path,
) -> None:
    model = FakeAnthropic(delay=MODEL_SECONDS)
    with model, economy_stack(tmp_path, model) as (env, client):
        model.configure(batch_processing_seconds=600.0)  # nothing processed for a while
        with worker(tmp_path / "w", env, "w"):
            ingest(client)
            economy = submit_economy(client, 10)
            wait_for(lambda: len(model.batches()) == 1, "the provider batch made", 120)
            standard = submit_batch(client, BACKLOG)  # its chunks queued ahead of the cancel
            response = client.delete(f"/v1/batches/{economy}", headers=ACME)
            assert response.status_code == 200, response.text

            def provider_canceled() -> bool:
                return model.batches()[0]["status"] != "in_progress"

            # the provider's cancel comes while the standard batch's first items are still
            # waiting on the model: before, it came once the backlog ahead of it was taken
            wait_for(provider_canceled, "the provider batch canceled", MODEL_SECONDS * 0.8)
            done = batch_counts(client, standard)["counts"]
            assert done["succeeded"] + done["failed"] == 0, done
            assert client.delete(f"/v1/batches/{standard}", headers=ACME).status_code == 200
            wait_for(lambda: finished(client, economy), "the economy batch ended", 300)
            wait_for(lambda: finished(client, standard), "the standard batch ended", 300)
        body = batch_counts(client, economy)
        assert body["status"] == "canceled", body
        assert body["counts"]["canceled"] == 10, body
