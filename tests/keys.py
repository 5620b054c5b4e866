"""The API keys the tests' stacks serve (``SIFT_API_KEYS``), and their request headers."""

from __future__ import annotations

ACME_KEY = {
    "key": "acme-key-0001",
    "tenant": "acme",
    "webhook_secret": "whsec_YWNtZS1zZWNyZXQtMDEyMzQ1Njc4OQ==",
}
GLOBEX_KEY = {
    "key": "globex-key-0001",
    "tenant": "globex",
    "webhook_secret": "whsec_Z2xvYmV4LXNlY3JldC0wMTIzNDU2Nzg5",
}
ACME = {"Authorization": f"Bearer {ACME_KEY['key']}"}
GLOBEX = {"Authorization": f"Bearer {GLOBEX_KEY['key']}"}
