"""The settings object as the environment sets it: what an empty variable means, and the
rerank model's ``output_config.effort`` as the worker's bootstrap builds it."""

from __future__ import annotations

import pytest

from worker.errors import ConfigError
from worker.runtime.bootstrap import build_batch_client, build_reranker
from worker.settings import load_settings


@pytest.mark.parametrize(
    ("variable", "field"),
    [
        ("SIFT_GENERATION_EFFORT", "generation_effort"),  # README: "empty for models without it"
        ("SIFT_VECTOR_MIN_SIMILARITY", "vector_min_similarity"),  # DESIGN: unset by default
        ("SIFT_BROKER_VISIBILITY_TIMEOUT_SECONDS", "broker_visibility_timeout_seconds"),
        ("SIFT_GENERATION_MODEL", "generation_model"),
        ("SIFT_API_KEYS_FILE", "api_keys_file"),
    ],
)
def test_an_optional_settings_empty_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, variable: str, field: str
) -> None:
    monkeypatch.setenv(variable, "")
    assert getattr(load_settings(), field) is None


def test_an_empty_metrics_token_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # unset opens /metrics: a Secret gone missing must not do that silently
    monkeypatch.setenv("SIFT_METRICS_TOKEN", "")
    with pytest.raises(ConfigError, match="SIFT_METRICS_TOKEN"):
        load_settings()


def test_an_empty_required_setting_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIFT_GENERATION_TIMEOUT_SECONDS", "")
    with pytest.raises(ConfigError, match="SIFT_GENERATION_TIMEOUT_SECONDS"):
        load_settings()


@pytest.mark.parametrize(
    ("model", "effort", "sent"),
    [
        ("claude-haiku-4-5", None, None),  # the README's model, at the default (auto)
        ("claude-sonnet-4-6", None, "low"),
        ("claude-opus-4-7", None, "low"),
        ("claude-haiku-4-5", "", None),
        ("claude-sonnet-4-6", "none", None),
        ("claude-sonnet-4-6", "", None),
        ("claude-future-7", "high", "high"),  # a model newer than the table, a level set
    ],
)
def test_the_effort_the_worker_sends_each_model(
    monkeypatch: pytest.MonkeyPatch, model: str, effort: str | None, sent: str | None
) -> None:
    monkeypatch.setenv("SIFT_GENERATION_MODEL", f"anthropic:{model}")
    monkeypatch.delenv("SIFT_REDIS_URL", raising=False)
    if effort is not None:
        monkeypatch.setenv("SIFT_GENERATION_EFFORT", effort)
    settings = load_settings()
    reranker = build_reranker(settings)
    batches = build_batch_client(settings)  # the economy lane's Message Batches requests
    assert reranker is not None and batches is not None
    assert reranker.effort == sent  # type: ignore[attr-defined]
    assert batches.reranker.effort == sent
