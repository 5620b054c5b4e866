"""The gateway app in process (``TestClient``) on an integration module's redis-server, with
one tenant's key: what the modules that talk HTTP to a gateway alone share."""

from __future__ import annotations

from typing import Any

from worker.settings import ApiKey, Settings

KEY = "key-acme-0123456789"
ACME = {"Authorization": f"Bearer {KEY}"}
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LKLYYb"


def gateway_settings(redis_url: str, **changes: Any) -> Settings:
    """The gateway's settings on ``redis_url``, acme's key alone, with ``changes``."""
    keys = [ApiKey(key=KEY, tenant="acme", webhook_secret=SECRET)]
    return Settings(redis_url=redis_url, api_keys=keys, **changes)
