"""SIFT_ELASTICSEARCH_ANALYZER is checked when the settings load: a name Elasticsearch has no
built-in analyzer of would make its index template refused at every tenant's first write
(``mapper_parsing_exception``), so it stops the start naming the variable and what it takes."""

from __future__ import annotations

import pytest

from worker.errors import ConfigError
from worker.settings import ELASTICSEARCH_ANALYZERS, load_settings


def test_the_default_is_english() -> None:
    assert load_settings().elasticsearch_analyzer == "english"


@pytest.mark.parametrize("name", ["klingon", "English", "chinese", "", "whitespace"])
def test_a_name_es_has_no_built_in_language_analyzer_of_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(elasticsearch_analyzer=name)
    message = refused.value.message
    assert "SIFT_ELASTICSEARCH_ANALYZER" in message
    assert "'standard'" in message and "'french'" in message  # what it takes


def test_every_built_in_language_analyzer_and_standard_loads() -> None:
    assert {"standard", "english", "french", "german", "cjk", "sorani"} <= set(
        ELASTICSEARCH_ANALYZERS
    )
    for name in ELASTICSEARCH_ANALYZERS:
        assert load_settings(elasticsearch_analyzer=name).elasticsearch_analyzer == name
