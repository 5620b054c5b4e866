"""SIFT_ELASTICSEARCH_INDEX_PREFIX is checked when the settings load, not at a tenant's request."""

from __future__ import annotations

import pytest

from worker.errors import ConfigError
from worker.settings import load_settings


@pytest.mark.parametrize("prefix", ["_sift", "-sift", ".sift", "Sift-", "si ft", "a" * 65])
def test_a_prefix_elasticsearch_would_refuse_is_a_config_error_naming_the_variable(
    prefix: str,
) -> None:
    with pytest.raises(ConfigError, match="SIFT_ELASTICSEARCH_INDEX_PREFIX"):
        load_settings(elasticsearch_index_prefix=prefix)


@pytest.mark.parametrize("prefix", ["", "sift-", "team1.search_", "a" * 64])
def test_a_prefix_elasticsearch_takes_loads(prefix: str) -> None:
    assert load_settings(elasticsearch_index_prefix=prefix).elasticsearch_index_prefix == prefix
