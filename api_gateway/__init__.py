"""Sift's HTTP gateway: parse, authenticate, store the job record, enqueue by task name, answer.

from api_gateway import create_app
app = create_app()          # uvicorn api_gateway.app:create_app --factory (sift gateway: :serve)
"""

from __future__ import annotations

from api_gateway.app import create_app

__all__ = ["create_app"]
