"""Slots shared out among tenants: one tenant's hung work never holds every one of them.

Stdlib only: the gateway's SSRF guard shares its name lookups' threads out by the same rule.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class TenantSlots:
    """At most ``limit`` things at once (webhook deliveries in one worker process, or name
    lookups waiting on the resolver), and at most ``per_tenant`` of them one tenant's; a full
    house (or a tenant's full share) is not waited for (the webhook task puts its delivery
    off; a lookup is refused), so deliveries never hold every thread.

    A quarter of the slots (:attr:`reserved`, 4 of 16) are kept for tenants sending nothing
    else: a tenant already sending takes another slot only while that leaves them free, and
    a tenant sending none takes any free slot. So tenants whose receivers hang hold one
    tenant's share and one slot each of the others, and the next tenant's webhook still finds
    a slot (at the defaults: 12 + 1 + 1 + 1 + 1 before a sixth tenant waits). A share alone
    left the rest to the second tenant to come: two hung receivers held 12 + 4, every slot.

    >>> slots = TenantSlots(2, per_tenant=1)
    >>> with slots.take("a") as first, slots.take("a") as second, slots.take("b") as third:
    ...     (first, second, third)
    (True, False, True)
    >>> slots = TenantSlots(8, per_tenant=6)  # 2 kept
    >>> [slots.acquire("a") for _ in range(7)], slots.acquire("b"), slots.acquire("b")
    ([True, True, True, True, True, True, False], True, False)
    >>> slots.acquire("c"), slots.acquire("d")
    (True, False)
    """

    def __init__(self, limit: int, per_tenant: int | None = None) -> None:
        self.limit = limit
        self.per_tenant = min(per_tenant or limit, limit)
        self.reserved = limit // 4
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()  # slots held, by tenant

    def acquire(self, tenant: str = "") -> bool:
        """Take a slot for ``tenant`` if the rule allows it now (never waits); True if taken.
        A slot taken is given back with :meth:`release`."""
        with self._lock:
            held = self._held[tenant]
            free = self.limit - self._held.total()
            got = free > 0 and held < self.per_tenant and (not held or free > self.reserved)
            if got:
                self._held[tenant] += 1
            return got

    def held(self) -> int:
        """Slots held now, every tenant's."""
        with self._lock:
            return self._held.total()

    def release(self, tenant: str = "") -> None:
        with self._lock:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]

    @contextmanager
    def take(self, tenant: str = "") -> Iterator[bool]:
        """True while holding a slot; False, at once, when the rule gives ``tenant`` none."""
        got = self.acquire(tenant)
        try:
            yield got
        finally:
            if got:
                self.release(tenant)
