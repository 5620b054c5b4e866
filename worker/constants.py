"""Every name Sift shares across processes: Redis keys, queues, tasks, metrics, policy ids."""

from __future__ import annotations

# --- search algorithm (DESIGN.md §2, §3) ---
RRF_K = 60
MAX_RANK_CONSTANT = 10_000  # the largest RRF rank constant a request or an index may set
# A fusion weight past this is refused (422): weights only matter relative to each other, and
# linear fusion sums weight x score, which overflows a float near 1e308.
MAX_FUSION_WEIGHT = 1_000_000
MAX_CANDIDATE_LIMIT = 200  # the largest rerank candidate window (SIFT_RERANK_CANDIDATE_LIMIT)
MIN_CHANNEL_WINDOW = 32
CHANNEL_WINDOW_FACTOR = 4
POLICY_ID = "listwise.v2"

# --- Redis keys: every prefix lives here ---
REDIS_PREFIX = "sift:"
SEARCH_KEY = REDIS_PREFIX + "search:"  # + job id -> job record (JSON)
BATCH_KEY = REDIS_PREFIX + "batch:"  # + batch id -> batch record (JSON)
BATCH_ITEMS_KEY = REDIS_PREFIX + "batch-items:"  # + batch id -> hash query_id -> item record
BATCH_COUNTS_KEY = REDIS_PREFIX + "batch-counts:"  # + batch id -> hash status -> count
IDEMPOTENCY_KEY = REDIS_PREFIX + "idem:"  # + tenant + key -> {fingerprint, job id}
ATTEMPTS_KEY = REDIS_PREFIX + "attempts:"  # + task id + ":" + retry number -> delivery counter
# + task id + ":" + retry number -> how many of that message's deliveries were left uncounted
# as an outage's returns (DeliveryRecords.count_delivery); lives as its delivery counter does
ATTEMPTS_FREED_KEY = REDIS_PREFIX + "attempts-freed:"
BATCH_ORDER_KEY = REDIS_PREFIX + "batch-order:"  # + batch id -> list of query ids, submission order
BATCH_SPECS_KEY = REDIS_PREFIX + "batch-specs:"  # + batch id -> hash query_id -> SearchSpec JSON
BATCH_RESULTS_KEY = REDIS_PREFIX + "batch-results:"  # + batch id -> hash query_id -> outcome JSON
# + batch id -> hash query_id -> the token and answer of the move that made the item final
BATCH_MOVES_KEY = REDIS_PREFIX + "batch-moves:"
# + batch id -> hash query id -> "<seconds used>|<worker id>|<claimed at>|<token>" (Redis's
# clock; token '' once let go): each item's run claim (worker/queue/jobstore/runs.py), with
# the batch record's TTL; a search keeps its own in its record's "run" field
BATCH_RUNS_KEY = REDIS_PREFIX + "batch-runs:"
BATCH_LOST_KEY = REDIS_PREFIX + "batch-lost:"  # + batch id -> hash query id -> runs lost
# + batch id -> hash "<start>-<stop>" -> the run claim of the chunk task over those positions
# (the value as an item's), so a copy of a chunk's message is refused while a live run of the
# chunk holds it; with the batch record's TTL
BATCH_CHUNK_RUNS_KEY = REDIS_PREFIX + "batch-chunk-runs:"
INGEST_KEY = REDIS_PREFIX + "ingest:"  # + ingest job id -> job record (hash)
INGEST_DOCS_KEY = REDIS_PREFIX + "ingest-docs:"  # + ingest job id -> documents JSON
# the index lifecycle (issue 13): every accepted write's version, and index reads' answers
# the counter of earlier releases, shared by every tenant: now only where each tenant's starts
WRITE_VERSION_KEY = REDIS_PREFIX + "write-version"
WRITE_VERSION_TENANT_KEY = REDIS_PREFIX + "write-version:"  # + tenant -> its last version, no TTL
# hash {mark, seen}: where this release last left the shared counter, and when a write of an
# earlier release (the counter moved since) was last noticed; no TTL (worker/write_versions.py)
LEGACY_WRITE_VERSION_KEY = REDIS_PREFIX + "write-version-legacy"
# how long after an earlier release's last write each write still moves the shared counter
LEGACY_WRITE_VERSION_WINDOW_SECONDS = 24 * 3600
INDEX_REPLY_KEY = REDIS_PREFIX + "index-reply:"  # + request id -> list holding a read's answer
# an index's own search settings (issue 15): weighted RRF and the candidate window, per tenant
# kept by the backend since; an earlier release's are still read where the backend has none
INDEX_SETTINGS_KEY = REDIS_PREFIX + "index-settings:"  # + tenant + ":" + index -> JSON, no TTL
# held while a change or a clear of an index's settings reads, then stores them
INDEX_SETTINGS_LOCK_KEY = REDIS_PREFIX + "index-settings-lock:"  # + tenant + ":" + index
INDEX_SETTINGS_LOCK_SECONDS = 30.0  # a holder that died lets go after this
# what a tenant's index holds, as a worker read it from the backend after its last write job:
# the gateway prices a batch's hits by it (api_gateway/backpressure.py)
INDEX_SIZE_KEY = REDIS_PREFIX + "index-size:"  # + tenant + ":" + index -> hash, no TTL
# the economy lane (issue 7): a batch's prepared searches and its provider batches
ECONOMY_PREPARED_KEY = REDIS_PREFIX + "eco-prepared:"  # + batch id -> hash query id -> JSON
ECONOMY_RUNS_KEY = REDIS_PREFIX + "eco-runs:"  # + batch id -> hash query id -> rerank run JSON
ECONOMY_PROVIDERS_KEY = REDIS_PREFIX + "eco-providers:"  # + batch id -> hash provider id -> JSON
ECONOMY_STATE_KEY = REDIS_PREFIX + "eco-state:"  # + batch id -> hash: submit claim, counters
# a field of that hash: + submission -> the candidate (provider batch id) whose poll sends
# the items of that create in doubt again, once every candidate ended without a line of it:
# one poll only, however many map their candidates at the same instant
ECONOMY_RESEND_CLAIM = "resend "
# a field of that hash: + submission -> when its create's run last held its lease just before
# a piece of the body went out: the latest its batch can have been made, give or take the
# provider's own time (a run taken over stops its upload short, the body incomplete)
ECONOMY_SENDING_MARK = "sending "
# a field of that hash: + economy task ("submit" or a provider batch id) -> the run that last
# took its lease: a lease that ran out while Redis was away is kept by that run again, one
# that another run took since (and maybe gave back) is not
ECONOMY_LEASED_MARK = "leased "
# a field of that hash: + provider batch id -> set once Sift's cancel of it (the user's)
# reached it before it ended: its ``canceled`` lines are the user's, whatever the clocks read
ECONOMY_CANCEL_SENT_MARK = "cancel-sent "
# zset "<batch id> <provider batch id | submit>" -> the time by which that economy task
# should have run again: the re-drive's sweep sends one past it (a lost message)
ECONOMY_WATCH_KEY = REDIS_PREFIX + "eco-watch"
# + "<batch id> <provider batch id | submit>" -> "<worker id> <run token>": the one run of that
# economy task under way, kept alive by its process (a second run of it stands down while the
# lease lives and that worker's heartbeat does)
ECONOMY_LEASE_KEY = REDIS_PREFIX + "eco-lease:"
STATS_KEY = REDIS_PREFIX + "stats:jobs"  # hash state -> jobs and items queued/running now
STATS_UNTRACKED_KEY = REDIS_PREFIX + "stats:untracked"  # same, for ingest jobs (not in the gauge)
# the searches and batch items each gateway admitted and is still storing
# (api_gateway/backpressure.py):
# zset token -> when its hold lapses (ms, Redis's clock), and hash token -> items
BACKLOG_HOLDS_KEY = REDIS_PREFIX + "backlog-holds"
BACKLOG_HELD_KEY = REDIS_PREFIX + "backlog-held"
# the re-drive (worker/queue/redrive.py): unfinished jobs, what the sweeper keeps between sweeps
ACTIVE_JOBS_KEY = REDIS_PREFIX + "active"  # zset: search, ingest, standard batch ids -> progress
# zset: search and batch ids whose webhook is owed -> when its next message is due (the final
# move, or its retry's time); the delivery task drops it once final (worker/queue/redrive.py)
WEBHOOKS_OWED_KEY = REDIS_PREFIX + "webhooks-owed"
REDRIVE_LEADER_KEY = REDIS_PREFIX + "redrive:leader"  # string: the worker sweeping this interval
REDRIVE_SUSPECTS_KEY = REDIS_PREFIX + "redrive:suspects"  # hash job id -> positions found lost
# hash search or batch id -> due time of its owed webhook found with no message (urgent window)
REDRIVE_WEBHOOK_SUSPECTS_KEY = REDIS_PREFIX + "redrive:webhook-suspects"
REDRIVE_COUNT_KEY = REDIS_PREFIX + "redrives:"  # + job id -> how many times it was re-driven
# + batch id -> hash position -> how many times that item's position was re-driven
REDRIVE_POSITIONS_KEY = REDIS_PREFIX + "redrive-positions:"
# + job id -> hash position -> runs of it that Redis unreachable ended, noted once it answered
# again, not yet re-driven nor come back ("<position>:freed": how many re-drives such notes have
# made free; "m:<task id>:<retry>": the positions a message's note covers, until it comes back)
REDRIVE_OUTAGES_KEY = REDIS_PREFIX + "redrive-outages:"
# string with a TTL: while it is set, a sweep looks at every active job, not only the stalled
# ones (set right after a dead worker or a Redis restart, the events that lose a message)
REDRIVE_URGENT_KEY = REDIS_PREFIX + "redrive:urgent"
REDRIVE_RUN_ID_KEY = REDIS_PREFIX + "redrive:run-id"  # string: Redis's run_id at the last sweep
# dead-worker recovery (worker/queue/liveness.py): each worker process's heartbeat, and which worker
# holds each broker delivery
WORKER_HEARTBEAT_KEY = REDIS_PREFIX + "worker-alive:"  # + worker id -> string with a TTL
WORKERS_KEY = REDIS_PREFIX + "workers"  # set: worker ids beating, until found dead or stopped
DELIVERY_OWNERS_KEY = REDIS_PREFIX + "deliveries"  # hash delivery tag -> worker id holding it
LIVENESS_LEADER_KEY = REDIS_PREFIX + "liveness:leader"  # string: the worker checking this beat
# the embedded backend's one data folder per Redis (worker/queue/data_folder.py): the folder id
# and "host:path" of the folder the live workers serve, and who holds it (a zset: each worker
# process beating, and a starting `sift worker`, -> when its hold lapses, ms on Redis's clock)
DATA_FOLDER_KEY = REDIS_PREFIX + "data-folder"  # string "<folder id> <host>:<path>"
DATA_FOLDER_HOLDERS_KEY = REDIS_PREFIX + "data-folder:holders"
# string with the heartbeat's TTL, set at each beat of every worker that can send an economy
# batch (a generation model, the batch queue consumed): that model, while one such worker lives
ECONOMY_SENDER_KEY = REDIS_PREFIX + "economy-sender"
# hash: worker id -> when the checks first found it without a heartbeat; "~last": the last check
LIVENESS_SUSPECTS_KEY = REDIS_PREFIX + "liveness:suspects"
# the provider's rate limits, one budget for every worker process (worker/adapters/rate_budget/)
RATE_BUDGET_KEY = REDIS_PREFIX + "rate-budget:"  # + lane + ":" + model -> hash: the buckets
# + model -> hash: provider batch id -> "requests expiry", the economy lane's processing queue
RATE_BUDGET_QUEUE_KEY = REDIS_PREFIX + "rate-budget-queue:"
# the job lists (GET /v1/searches, /v1/batches, /v1/ingestions): one index per kind and tenant
JOB_INDEX_KEY = REDIS_PREFIX + "jobs:"  # + kind + ":" + tenant -> zset job id -> created_at
# + search or batch id -> hash {tenant, kind, erased_at}: the job a tenant erased (its record
# and every key of it deleted), kept for the retention so its GET answers 410 erased
ERASED_KEY = REDIS_PREFIX + "erased:"
# + erased batch id -> set of provider batch ids: an erased economy batch's provider batches
# that Sift made and has not deleted at the provider yet (ECONOMY_DELETE_TASK empties it)
ECONOMY_DELETE_KEY = REDIS_PREFIX + "eco-delete:"
# + erased batch id -> hash provider batch id -> submission: an erased economy batch's
# candidates of a create in doubt that no poll had judged, judged by ECONOMY_DELETE_TASK once
# they end (deleted at the provider if their results prove them ours, else left)
ECONOMY_DELETE_CANDIDATES_KEY = REDIS_PREFIX + "eco-delete-candidates:"
# + erased batch id -> hash provider batch id -> its create's submission ('': one Sift made):
# those whose delete (or judgement) the provider refused for the key (401, 403), kept with the
# retention of the set they came from and asked again once when a worker starts (a new key
# usually comes with a restart)
ECONOMY_DELETE_REFUSED_KEY = REDIS_PREFIX + "eco-delete-refused:"
# hash erased batch id -> the token of the delete task a starting worker sent to ask its
# refused ones again ('': none sent since the last refusal)
ECONOMY_DELETE_REFUSALS_KEY = REDIS_PREFIX + "eco-delete-refusals"
# + erased batch id -> set of provider batch ids whose delete the provider refused for the key
# and was counted (sift_provider_batch_deletes_total{result="refused"}): a refusal is counted
# once per provider batch, however many starts ask it again; kept with the refused ones'
# retention, and deleted with the batch's delete chain once nothing is left
ECONOMY_DELETE_COUNTED_KEY = REDIS_PREFIX + "eco-delete-refused-counted:"
# + erased batch id -> string (a delete task's id), with a TTL a few polls long: the lease of
# the batch's one retrying delete task (its chain), renewed at each of its runs; another task
# for the batch finding it live hands its work (already in the sets the chain reads) over
ECONOMY_DELETE_CHAIN_KEY = REDIS_PREFIX + "eco-delete-chain:"
# string (a time): an erasure (an erase, a tenant purge) since Redis last rewrote its files,
# whose erased text its AOF or RDB snapshot may still hold (worker/queue/jobstore/rewrite.py)
REWRITE_OWED_KEY = REDIS_PREFIX + "rewrite-owed"
# string with a TTL of REWRITE_INTERVAL_SECONDS: a rewrite was started within the interval
REWRITE_LATCH_KEY = REDIS_PREFIX + "rewrite-latch"
# string with a TTL of REWRITE_INTERVAL_SECONDS: a payment of the owed rewrite is scheduled
# (a REWRITE_TASK message due at the latch's expiry), so a burst of erases schedules one
REWRITE_PAYMENT_KEY = REDIS_PREFIX + "rewrite-payment"

# --- retention (seconds), enforced by Redis TTLs; stated in docs/queue.md ---
RESULT_TTL_SECONDS = 7 * 24 * 3600  # job, batch and ingest records, counted from their end
# (the default of SIFT_RESULT_RETENTION_SECONDS; never below this: a webhook's 33 h of retries
# and an Idempotency-Key's 24 h run within it)
MIN_RESULT_RETENTION_SECONDS = 2 * 24 * 3600
IDEMPOTENCY_TTL_SECONDS = 24 * 3600  # an Idempotency-Key is remembered this long from its last use
# a claimed key with no job bound yet answers 409 this long at most (a request that died
# before creating its job); a key bound to its job is kept IDEMPOTENCY_TTL_SECONDS
IDEMPOTENCY_PENDING_TTL_SECONDS = 120
ATTEMPTS_TTL_SECONDS = 24 * 3600  # delivery counters
INGEST_DOCS_TTL_SECONDS = 24 * 3600  # documents waiting for their ingest task
INDEX_REPLY_TTL_SECONDS = 60  # an index read's answer, until the gateway takes it
# a worker process trusts its copy of an index's settings this long (a change made through
# another process shows within it; the process that made it sees it at once)
INDEX_SETTINGS_TTL_SECONDS = 2.0
INDEX_READ_TIMEOUT_SECONDS = 10.0  # the gateway waits this long for a worker's answer, then 503
# A settings change no worker has started within INDEX_READ_TIMEOUT_SECONDS is dropped unapplied;
# the gateway waits this much longer for one a worker started in time, so its 503 never hides
# a change that is applied later (behind a newer one). Hosts' clocks must agree within it (NTP).
INDEX_CHANGE_GRACE_SECONDS = 3.0
# index reads one gateway process waits on Redis for at once (a BLPOP slice each): half its
# asyncio client's 128 connections, so reads no worker answers leave searches the rest
INDEX_REPLY_WAITS = 64
# a batch's items, or an ingest's documents, written before its record, until committed
BATCH_STAGING_TTL_SECONDS = 3600
BATCH_STAGE_SLICE = 1_000  # a batch's items per Redis command (Redis serves others between)
# a tenant's job index keeps its members this many retention periods (a record lives one
# from its last write); reads drop the members whose record has expired before that
JOB_INDEX_RETENTIONS = 2
MAX_LIST_SCAN = 5_000  # index members one list request reads at most (a status filter's scan)
# ... and the bytes of their records' large fields it reads at most (a search's spec, with its
# filters, is up to ~830 kB); the member that passes it starts the next page. A page of an
# index's documents ends there too (each shows its metadata, up to ~830 kB)
MAX_LIST_READ_BYTES = 8 * 1024 * 1024
# Redis is asked to rewrite its files (BGREWRITEAOF; BGSAVE with save points) at most once in
# this long after an erasure, so an erased text leaves its disk within it and a burst of
# erases forks one rewrite, not one each (worker/queue/jobstore/rewrite.py)
REWRITE_INTERVAL_SECONDS = 300

# --- job ids: a prefix names the kind ---
SEARCH_ID_PREFIX = "srch_"
BATCH_ID_PREFIX = "bat_"
INGEST_ID_PREFIX = "ing_"

# --- Celery ---
SEARCH_QUEUE = "sift.search"  # single searches, interactive
BATCH_QUEUE = "sift.batch"  # batch chunks, so a big batch never starves single searches
INGEST_QUEUE = "sift.ingest"
WEBHOOK_QUEUE = "sift.webhooks"
SEARCH_TASK = "sift.search"
BATCH_CHUNK_TASK = "sift.batch_chunk"
INGEST_TASK = "sift.ingest"
INDEX_READ_TASK = "sift.index_read"  # list / show an index, read a document (search queue)
WEBHOOK_TASK = "sift.webhook"
ECONOMY_SUBMIT_TASK = "sift.economy_submit"  # on BATCH_QUEUE: send a batch's prompts
ECONOMY_POLL_TASK = "sift.economy_poll"  # on BATCH_QUEUE: poll one provider batch, map results
ECONOMY_CANCEL_TASK = "sift.economy_cancel"  # on SEARCH_QUEUE: cancel a batch's provider batches
# on SEARCH_QUEUE: delete an erased batch's provider batches (their requests and results)
ECONOMY_DELETE_TASK = "sift.economy_delete"
REWRITE_TASK = "sift.rewrite_owed"  # on SEARCH_QUEUE: pay the rewrite an erase left owed
CANCEL_COUNT_TASK = "sift.cancel_count"  # on BATCH_QUEUE: count what a batch's cancel ended
# every task a worker runs: its sift_task_retries_total series is made at zero when it starts
TASK_NAMES = (
    SEARCH_TASK, BATCH_CHUNK_TASK, INGEST_TASK, INDEX_READ_TASK, WEBHOOK_TASK,
    ECONOMY_SUBMIT_TASK, ECONOMY_POLL_TASK, ECONOMY_CANCEL_TASK, ECONOMY_DELETE_TASK,
    REWRITE_TASK, CANCEL_COUNT_TASK,
)  # fmt: skip
ALL_QUEUES = (SEARCH_QUEUE, BATCH_QUEUE, INGEST_QUEUE, WEBHOOK_QUEUE)
# an ingest or delete task's soft time limit (seconds): its job's budget, which a backend's
# own long wait (an Elasticsearch drop's delete task) stays within
INGEST_TIME_LIMIT_SECONDS = 600.0
# kombu's Redis transport: priority 0 lives in the queue's own list, the other steps of its
# PRIORITY_STEPS [0, 3, 6, 9] in lists named queue + separator + step; a message a worker has
# taken but not acked is a field of the "unacked" hash, its value [message, exchange, key] JSON
KOMBU_PRIORITY_SEPARATOR = "\x06\x16"
KOMBU_PRIORITY_STEPS = (3, 6, 9)
KOMBU_UNACKED_KEY = "unacked"
KOMBU_UNACKED_INDEX_KEY = "unacked_index"  # zset delivery tag -> when it was taken (unix time)
KOMBU_BINDING_PREFIX = "_kombu.binding."  # + exchange -> set "key\x06\x16pattern\x06\x16queue"


def kombu_queue_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps one queue in: the queue's own, then one per priority."""
    return [queue] + [f"{queue}{KOMBU_PRIORITY_SEPARATOR}{step}" for step in KOMBU_PRIORITY_STEPS]


WEBHOOK_EVENT_SEARCH_COMPLETED = "search.completed"
WEBHOOK_EVENT_BATCH_COMPLETED = "batch.completed"

# --- the queue's own metrics (extensions; defined in worker/observability/, api_gateway) ---
METRIC_TASK_DURATION = "sift_task_duration_seconds"
METRIC_TASK_RETRIES = "sift_task_retries_total"
METRIC_HTTP_REQUESTS = "sift_http_requests_total"
METRIC_HTTP_DURATION = "sift_http_request_duration_seconds"

# --- metrics (DESIGN.md §9; names there are binding, the rest are extensions) ---
METRIC_SEARCH_DURATION = "sift_search_duration_seconds"
METRIC_QUEUE_WAIT = "sift_job_queue_wait_seconds"
METRIC_RETRIEVAL_DURATION = "sift_retrieval_duration_seconds"
METRIC_RETRIEVAL_HITS = "sift_retrieval_hits"
METRIC_CPU_SLOT_WAIT = "sift_cpu_slot_wait_seconds"  # a worker process's CPU slots
METRIC_RERANK_DURATION = "sift_rerank_duration_seconds"
METRIC_RERANK_TOKENS = "sift_rerank_tokens_total"
METRIC_RERANK_ATTEMPTS = "sift_rerank_attempts_total"
METRIC_RERANK_OUTCOMES = "sift_rerank_outcomes_total"
METRIC_RERANK_COST = "sift_rerank_cost_usd_total"
METRIC_RERANK_UNPRICED = "sift_rerank_unpriced_calls_total"
# attempts sent with no answer read (a timeout, a lost connection): possibly billed, not read
METRIC_RERANK_UNREAD = "sift_rerank_unread_attempts_total"
METRIC_RERANK_UNREAD_INPUT = "sift_rerank_unread_input_tokens_total"
METRIC_JOBS_IN_FLIGHT = "sift_jobs_in_flight"
METRIC_WEBHOOK_DELIVERIES = "sift_webhook_deliveries_total"
# extensions
METRIC_RERANK_IN_FLIGHT = "sift_rerank_in_flight"
METRIC_QUEUE_BACKLOG = "sift_queue_backlog"
METRIC_JOBS_SUBMITTED = "sift_jobs_submitted_total"
METRIC_JOBS_COMPLETED = "sift_jobs_completed_total"
METRIC_JOB_FAILURES = "sift_job_failures_total"
METRIC_REDRIVEN = "sift_redriven_total"
METRIC_RATE_BUDGET_WAIT = "sift_rate_budget_wait_seconds"  # the shared rate budget
# ... and its settlements Redis failed, dropped (never raised over the call's outcome)
METRIC_RATE_BUDGET_UNSETTLED = "sift_rate_budget_unsettled_total"
METRIC_PROVIDER_429 = "sift_provider_429_total"  # 429 answers of the model provider
# an erased batch's provider batches, deleted at the provider or refused for good
METRIC_PROVIDER_DELETES = "sift_provider_batch_deletes_total"
# ... and those whose delete (or a candidate's read) the provider refused, still kept aside
METRIC_PROVIDER_DELETES_REFUSED = "sift_provider_batch_deletes_refused"
METRIC_WEBHOOK_DEFERRALS = "sift_webhook_deferrals_total"  # put off: slots (or a share) full
# index reads and settings changes a worker took after their gateway gave up, dropped unrun
METRIC_INDEX_READS_DROPPED = "sift_index_reads_dropped_total"
METRIC_WORKER_PROCESSES = "sift_worker_processes"  # a sift worker supervisor's processes
METRIC_WORKER_RESTARTS = "sift_worker_restarts_total"  # ... that exited unasked, restarted
METRIC_CLOCK_SKEW = "sift_clock_skew_seconds"  # a host's wall clock minus Redis's
# the Prometheus scrape job names the rules and dashboards expect
PROMETHEUS_JOB_WORKER = "sift-worker"
PROMETHEUS_JOB_GATEWAY = "sift-gateway"

# --- the economy lane: the provider's Message Batches price and limits ---
ECONOMY_PRICE_DISCOUNT = 0.5  # the Message Batches API bills half the token price
ECONOMY_MAX_REQUESTS_PER_BATCH = 100_000  # the provider's limit per Message Batch
ECONOMY_MAX_BATCH_BYTES = 256_000_000  # the provider's limit on a Message Batch's body (256 MB)
LANE_STANDARD = "standard"
LANE_ECONOMY = "economy"
LANES = (LANE_STANDARD, LANE_ECONOMY)  # a batch's lanes, and the metrics' lane label

# --- the gateway's 503 error types a client acts on (docs/queue.md, "The 503s"; the last,
# docs/security.md, "Removing a tenant") ---
# Redis down, restarting or not answering in time: a write may have been made before the
# failure (a timeout can come after it), so only a request safe to repeat is sent again
ERROR_UNAVAILABLE = "unavailable"
# Redis at (or, for new jobs, near) its maxmemory refused the request: nothing was stored,
# so any request so refused may be sent again, a delete job's too
ERROR_JOB_STORE_FULL = "job_store_full"
# `sift gateway` still waiting for its Redis and its start checks: it took the request for
# nothing and stored nothing, so any request may be sent again, a delete job's too
ERROR_STARTING = "starting"
# the tenant was removed from the workers' keys: a failed job's type, and the 503 of an index
# read its gateway sends until it restarts without the key; that lasts, so it is not retried
ERROR_TENANT_REMOVED = "tenant_removed"

# --- limits (validated at the gateway, documented in docs/security.md) ---
MAX_QUERY_CHARS = 2_000
# the words of a query its BM25 channel searches (worker.core.query.bm25_cut): Elasticsearch
# makes a leaf clause of each token in each field, and a node refuses a search of more than
# max(1024, heap_MB * 64 / search_threads); 256 words over two fields, with a search's most
# filters (MAX_FILTER_KEYS), stay under 1,024
MAX_BM25_WORDS = 256
MAX_LIMIT = 100
MAX_BATCH_QUERIES = 100_000
MAX_DOCUMENTS_PER_REQUEST = 1_000
MAX_DOCUMENT_CHARS = 100_000
# a document's title and revision, and its metadata keys: each is stored and shown with the
# document, in every hit and listing page that shows it (a 5 MB title made a 23 MB answer)
MAX_TITLE_CHARS = 2_000
MAX_REVISION_CHARS = 256
MAX_METADATA_KEYS = 100
MAX_WAIT_SECONDS = 30.0
MAX_BATCH_QUERY_ID_CHARS = 256
MAX_METADATA_KEY_CHARS = 128  # the backends' filter-name pattern allows no more
# a string metadata or filter value, in UTF-8 bytes: Elasticsearch indexes each as one term
# (with its key, in ``metadata_terms``), and Lucene refuses a term over 32,766 bytes
MAX_METADATA_VALUE_BYTES = 8_192
# a search's filter keys: ANDed in one SQL expression, which SQLite refuses deeper than 1,000
# (a number's key takes two terms); far more than a filter needs
MAX_FILTER_KEYS = 100
MAX_PAGE_SIZE = 1_000
DEFAULT_PAGE_SIZE = 100
# a batch's results page also ends once its items' stored results reach this many bytes (one
# item past it is a page alone): items of 100 hits of long documents are ~10 MB each, and a
# page of 100 of them, built whole in the gateway's memory, was 948 MB of JSON
MAX_RESULTS_PAGE_BYTES = 8 * 1024 * 1024
# a document listing shows this many characters of each text (GET one document for all of it)
DOCUMENT_PREVIEW_CHARS = 200
MAX_WEBHOOK_URL_CHARS = 2_048
MAX_IDEMPOTENCY_KEY_CHARS = 255

# A worker stopped while its warm-up makes the embedding graph waits this long for it
WARM_UP_STOP_WAIT_SECONDS = 30.0
