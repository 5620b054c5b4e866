"""Redis asked to rewrite its files after an erasure, so the erased text leaves its disk.

Why. An erase (:mod:`~worker.queue.jobstore.erasure`) or a tenant purge
(:mod:`~worker.queue.jobstore.tenants`) deletes keys in memory; Redis's AOF, as ``sift up`` and
``deploy/`` run it, still holds the writes that stored them (queries, hits' text) until Redis
rewrites it, on its own only once the file has doubled (``auto-aof-rewrite-percentage``): on a
quiet store, days. An RDB snapshot holds them until the next save.

How. The erase's script, and the purge once it has deleted, mark a rewrite owed
(:data:`~worker.constants.REWRITE_OWED_KEY`); whoever takes the latch
(:data:`~worker.constants.REWRITE_LATCH_KEY`, ``SET NX EX``
:data:`~worker.constants.REWRITE_INTERVAL_SECONDS`) pays it: the erase itself when no rewrite
was started within the interval, else a worker once the latch has expired: an erase the latch
held back has the task :data:`~worker.constants.REWRITE_TASK` sent, due at the latch's expiry
(:func:`schedule_payment`, once per interval: :data:`~worker.constants.REWRITE_PAYMENT_KEY`),
and the re-drive's sweep pays it too. So a burst of erases forks one rewrite per interval, not
one each, and the last of them is off the disk an interval after it at most. Before, only the
sweep paid it: with the re-drive off (``SIFT_REDRIVE_INTERVAL_SECONDS=0``) the text stayed on
the disk until the next erase past the interval, however long that was. The mark is dropped
before the rewrite is asked: an erasure that marks it after the drop keeps it owed for the
next one, and one that marked it before is in this one (Redis forks the rewrite after the
command). A rewrite already running may have forked before the erasure: the mark is set
again, for the next interval.

What is asked: ``BGREWRITEAOF`` when the AOF is on, ``BGSAVE SCHEDULE`` when RDB save points
are set (after the AOF's rewrite, if both), nothing when Redis keeps no file. A Redis that
refuses them (a managed one that renames ``CONFIG``, say) is logged at WARNING, once an
interval: its files keep the text until its own rewrite.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from enum import StrEnum
from typing import cast

import redis

from worker.constants import (
    REWRITE_INTERVAL_SECONDS,
    REWRITE_LATCH_KEY,
    REWRITE_OWED_KEY,
    REWRITE_PAYMENT_KEY,
)

log = logging.getLogger(__name__)


class Rewrite(StrEnum):
    """What :func:`rewrite_if_owed` did."""

    NOT_OWED = "not_owed"  # no erasure since the last rewrite asked
    LATCHED = "latched"  # one was started within the interval: still owed, for the next
    STARTED = "started"  # asked (a rewrite started, or scheduled after a child running)
    BUSY = "busy"  # one was running already (it may predate the erasure): owed again
    NO_FILES = "no_files"  # Redis keeps no AOF and no RDB save points: nothing on disk
    REFUSED = "refused"  # Redis refused the commands: its files keep the text
    FAILED = "failed"  # Redis did not answer: owed again, if it could be told


def owe_rewrite(client: redis.Redis) -> None:
    """Mark a rewrite owed (the erase's script writes the same key itself)."""
    client.set(REWRITE_OWED_KEY, repr(time.time()))


def rewrite_commands(appendonly: str, save: str) -> list[tuple[str, ...]]:
    """The commands that rewrite the files Redis keeps, by its ``appendonly`` and ``save``
    settings: the AOF's rewrite, then an RDB save (``SCHEDULE``: after a child running).

    >>> rewrite_commands("yes", "")
    [('BGREWRITEAOF',)]
    >>> rewrite_commands("no", "3600 1")
    [('BGSAVE', 'SCHEDULE')]
    """
    commands: list[tuple[str, ...]] = []
    if appendonly.strip().lower() == "yes":
        commands.append(("BGREWRITEAOF",))
    if save.strip():
        commands.append(("BGSAVE", "SCHEDULE"))
    return commands


def _busy(exc: redis.ResponseError) -> bool:
    """Whether Redis refused because a rewrite or save is running already."""
    message = str(exc).lower()
    return "in progress" in message or "child process" in message


def rewrite_if_owed(
    client: redis.Redis, interval_seconds: float = REWRITE_INTERVAL_SECONDS
) -> Rewrite:
    """Ask Redis to rewrite its files if an erasure owes it and none was started within
    ``interval_seconds``."""
    if not client.exists(REWRITE_OWED_KEY):
        return Rewrite.NOT_OWED
    latch = max(1, int(interval_seconds))
    if not client.set(REWRITE_LATCH_KEY, repr(time.time()), nx=True, ex=latch):
        return Rewrite.LATCHED
    client.delete(REWRITE_OWED_KEY)  # before the command: an erasure after it stays owed
    try:
        config = cast(dict[str, str], client.config_get("appendonly"))
        config.update(cast(dict[str, str], client.config_get("save")))
        commands = rewrite_commands(config.get("appendonly", "no"), config.get("save", ""))
        for command in commands:
            client.execute_command(*command)  # type: ignore[no-untyped-call]
    except redis.ResponseError as exc:
        if _busy(exc):
            owe_rewrite(client)
            return Rewrite.BUSY
        log.warning("Redis refused to rewrite its files after an erasure (%s): its AOF or "
                    "RDB keeps the erased text until it rewrites them itself", exc)  # fmt: skip
        return Rewrite.REFUSED
    except redis.RedisError as exc:
        log.warning("Redis not asked to rewrite its files after an erasure: %s", exc)
        with contextlib.suppress(redis.RedisError):  # not told: the next erasure owes it
            owe_rewrite(client)
        return Rewrite.FAILED
    if commands:
        log.info("asked Redis to rewrite its files after an erasure: %s",
                 ", ".join(" ".join(c) for c in commands))  # fmt: skip
        return Rewrite.STARTED
    return Rewrite.NO_FILES


def latch_left(client: redis.Redis) -> float:
    """Seconds until the latch lets the next rewrite be asked: at least 1 (none, or one
    expiring now)."""
    return max(1.0, client.pttl(REWRITE_LATCH_KEY) / 1000)


#: A task message due in so many seconds: (list key, raw message), as the broker keeps it.
DueMessage = Callable[[float], tuple[str, str]]


def schedule_payment(client: redis.Redis, send: Callable[[float], object]) -> bool:
    """Have a worker pay the rewrite the latch held back, when the latch expires:
    ``send(seconds left)`` sends the task due then, unless a payment is scheduled already
    this interval (:data:`~worker.constants.REWRITE_PAYMENT_KEY`, which lives until the
    message is due). Answers whether it sent one."""
    due = latch_left(client)
    if not client.set(REWRITE_PAYMENT_KEY, repr(time.time()), nx=True, ex=math.ceil(due)):
        return False
    send(due)
    return True


def pay_owed(client: redis.Redis) -> float | None:
    """The scheduled payment (:func:`schedule_payment`): the rewrite asked if still owed;
    None once done, else in how many seconds to ask again (the latch taken since, or a
    rewrite running, or Redis not answering), that retry holding the payment's key so no
    erase meanwhile schedules a second. The key goes first: an erase after it schedules its
    own payment, one before it is in this rewrite (or owes it again)."""
    client.delete(REWRITE_PAYMENT_KEY)
    if rewrite_if_owed(client) not in (Rewrite.LATCHED, Rewrite.BUSY, Rewrite.FAILED):
        return None
    due = latch_left(client)
    client.set(REWRITE_PAYMENT_KEY, repr(time.time()), nx=True, ex=math.ceil(due))
    return due
