"""Webhooks: Standard Webhooks delivery (:mod:`.delivery`) and the SSRF guard on their URLs
(:mod:`.urlguard`).

This file imports nothing, so the gateway's import of the guard (stdlib only) pulls in no
HTTP client.
"""
