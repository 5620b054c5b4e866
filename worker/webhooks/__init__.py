"""Webhooks: Standard Webhooks delivery (:mod:`.delivery`), the SSRF guard on their URLs
(:mod:`.urlguard`), and the slots both share out among tenants (:mod:`.shares`).

This file imports nothing, so the gateway's import of the guard (stdlib only) pulls in no
HTTP client.
"""
