"""The economy lane: a batch's reranks sent as Anthropic Message Batches, at half the price.

The flow (DESIGN.md §7; docs/lanes.md):

1. ``sift.batch_chunk`` runs each item's first half, :meth:`SearchPipeline.prepare`, on the
   runtime's economy pipeline: retrieval and fusion as in the standard lane. An item that
   needs no model call is finished there. The others' prepared state goes to
   ``sift:eco-prepared:<batch>``, and the item stays ``running``. The chunk that finds every
   item final or prepared enqueues ``sift.economy_submit``, once.
2. ``sift.economy_submit`` sends the prompts as Message Batches, chunked under the
   provider's limits (``SIFT_ECONOMY_MAX_REQUESTS_PER_BATCH``, 100,000 requests, and
   ``SIFT_ECONOMY_MAX_BATCH_BYTES``, 256 MB). Each request's ``custom_id`` is
   ``i<position>-<submission>``: the item's place in the submission order, and the token of
   the create that sent it; its ``params`` are the standard lane's own. Each create is
   written down before it is made, so that one whose answer was lost is found, not made
   twice (:mod:`~worker.queue.economy.doubts`). A failed call is retried at the poll cadence
   until the economy deadline. One ``sift.economy_poll`` per provider batch follows.
3. ``sift.economy_poll`` retrieves its provider batch with backoff
   (``SIFT_ECONOMY_POLL_SECONDS`` doubling up to ``SIFT_ECONOMY_POLL_MAX_SECONDS``) until it
   ended, then streams the JSONL results, in whatever order they come, and maps each line
   back by its ``custom_id`` (a line counts only if it names the item's current submission,
   and once):

   - ``succeeded``: the pipeline's second half, :meth:`SearchPipeline.finish`, with the
     model's positions: the same normalisation and fallback as the standard lane;
   - ``errored`` (its class from the error type), ``expired`` (class ``timeout``) and a
     ``succeeded`` answer that fails the schema or has more positions than the request's
     ``max_tokens`` lets a model write (the standard lane's check), or a line of an unknown
     shape (``malformed``): resubmitted in a new
     provider batch while the class is retryable, the attempt budget
     (``SIFT_GENERATION_MAX_REQUESTS``) lasts and ``SIFT_ECONOMY_DEADLINE_SECONDS`` since
     the batch was submitted has not passed (in a canceled batch, canceled instead); else
     the failure policy, as in the standard
     lane (``fail_closed``: the item fails with ``rerank_failed`` naming the class;
     ``fail_open``: coarse top-k with ``fallback_reason``);
   - ``canceled``: the item is canceled.
4. ``DELETE /v1/batches/{id}`` enqueues ``sift.economy_cancel``, which cancels the batch's
   provider batches (a poll does too, should it find the Sift batch canceled); their
   unprocessed requests come back ``canceled``.
5. ``DELETE /v1/batches/{id}/results`` (the erase) enqueues ``sift.economy_delete``, which
   deletes the batch's provider batches at the provider (:mod:`~worker.queue.economy.deletion`).

The Sift batch completes, and its webhook fires, when its last item is final: when the
results of its last provider batch have been mapped. Every write goes through the job
store's compare-and-set, and a run records which provider result it already counted, so a
redelivered task neither finishes an item twice nor counts an attempt twice; and one run of
each submission or poll goes on at a time (:mod:`~worker.queue.economy.leases`).

The modules, each on the ones before it (an import-linter contract keeps the order):
:mod:`~worker.queue.economy.ids` (custom ids, submission tokens, chunking),
:mod:`~worker.queue.economy.records` (what the lane keeps in Redis: prepared items, runs,
provider batches), :mod:`~worker.queue.economy.leases` (one run at a time, and its marks),
:mod:`~worker.queue.economy.watch` (each task's message, and its re-send when lost),
:mod:`~worker.queue.economy.finish` (an item's end), :mod:`~worker.queue.economy.doubts`
(creates whose answer never came), :mod:`~worker.queue.economy.cancel`,
:mod:`~worker.queue.economy.deletion`,
:mod:`~worker.queue.economy.submission`, :mod:`~worker.queue.economy.results` (mapping a
provider batch's lines) and :mod:`~worker.queue.economy.poll`. This package exports the
four tasks and what the chunk task, the re-drive and the tests use.
"""

from __future__ import annotations

from worker.queue.economy.cancel import economy_cancel
from worker.queue.economy.deletion import economy_delete
from worker.queue.economy.doubts import DOUBT_WINDOW_SECONDS
from worker.queue.economy.ids import (
    chunk_requests,
    custom_id,
    new_submission,
    position_of,
    submission_of,
)
from worker.queue.economy.leases import WATCH_MARGIN_SECONDS
from worker.queue.economy.poll import economy_poll
from worker.queue.economy.records import DOUBT, economy_pipeline, is_prepared, save_prepared
from worker.queue.economy.results import map_results
from worker.queue.economy.submission import economy_submit, maybe_submit, submit
from worker.queue.economy.watch import SUBMIT_CLAIM, rewake

__all__ = [
    "DOUBT",
    "DOUBT_WINDOW_SECONDS",
    "SUBMIT_CLAIM",
    "WATCH_MARGIN_SECONDS",
    "chunk_requests",
    "custom_id",
    "economy_cancel",
    "economy_delete",
    "economy_pipeline",
    "economy_poll",
    "economy_submit",
    "is_prepared",
    "map_results",
    "maybe_submit",
    "new_submission",
    "position_of",
    "rewake",
    "save_prepared",
    "submission_of",
    "submit",
]
