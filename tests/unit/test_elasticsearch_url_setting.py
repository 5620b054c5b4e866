"""SIFT_ELASTICSEARCH_URL may carry ``user:password@`` (deploy/docker-compose.yml passes the
``elastic`` password so): a setting refused for another reason must not print the password."""

from __future__ import annotations

import pytest

from worker.errors import ConfigError
from worker.settings import load_settings


@pytest.mark.parametrize(
    "settings",
    [
        {"elasticsearch_url": "http://elastic:s3cret@es.internal"},  # no port
        {"elasticsearch_url": "ftp://elastic:s3cret@es.internal:9200"},
        {
            "elasticsearch_url": "http://elastic:s3cret@es.internal:9200",
            "elasticsearch_ca_certs": "/ca.pem",
        },
    ],
)
def test_a_refused_elasticsearch_url_is_named_without_its_password(
    settings: dict[str, str],
) -> None:
    with pytest.raises(ConfigError, match="SIFT_ELASTICSEARCH_URL") as refused:
        load_settings(**settings)
    assert "s3cret" not in str(refused.value)
    assert "elastic:***@es.internal" in str(refused.value)
