"""The Elasticsearch client against an HTTPS loopback stand-in whose certificate a private
CA signed (ECK's and Elasticsearch 9's default security setup): trusted through
``SIFT_ELASTICSEARCH_CA_CERTS`` or ``SIFT_ELASTICSEARCH_SSL_FINGERPRINT``, refused, with an
error that says which settings fix it, without either or with a wrong fingerprint."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.es_loopback import (
    Answer,
    FakeElasticsearchServer,
    PrivateCa,
    private_ca,
    running,
)
from worker.adapters.elasticsearch import ElasticsearchBackend
from worker.errors import BackendUnavailable, ConfigError
from worker.settings import load_settings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

ALIASES = "/_alias/sift-*"  # the start-up check's one request: the shared layout's aliases
REFUSED = r"TLS certificate is not trusted.*SIFT_ELASTICSEARCH_CA_CERTS or SIFT_ELASTICSEARCH_SSL"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCa:
    return private_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def server(ca: PrivateCa) -> Iterator[FakeElasticsearchServer]:
    server = FakeElasticsearchServer(tls=ca.server_context())
    server.on("GET", ALIASES, Answer(200, {}))  # no alias of the shared layout
    yield from running(server)


def backend(server: FakeElasticsearchServer, **settings: Any) -> ElasticsearchBackend:
    return ElasticsearchBackend.from_settings(
        load_settings(search_backend="elasticsearch", elasticsearch_url=server.url, **settings)
    )


def test_the_stand_in_serves_https(server: FakeElasticsearchServer) -> None:
    assert server.url.startswith("https://127.0.0.1:")


def test_the_private_ca_is_trusted_through_its_pem_bundle(
    server: FakeElasticsearchServer, ca: PrivateCa
) -> None:
    backend(server, elasticsearch_ca_certs=ca.ca).check()
    assert len(server.sent("GET", ALIASES)) == 1


@pytest.mark.parametrize("which", ["node", "ca"])
def test_a_pinned_fingerprint_is_trusted(
    server: FakeElasticsearchServer, ca: PrivateCa, which: str
) -> None:
    """The node's own certificate's, or its CA's (what Elasticsearch prints at its first
    start: the HTTP CA certificate's SHA-256 fingerprint); colons or none."""
    fingerprint = ca.fingerprint(which)
    backend(server, elasticsearch_ssl_fingerprint=fingerprint).check()
    backend(server, elasticsearch_ssl_fingerprint=fingerprint.replace(":", "").lower()).check()
    assert len(server.sent("GET", ALIASES)) == 2


def test_without_either_the_private_ca_is_refused_naming_the_settings(
    server: FakeElasticsearchServer,
) -> None:
    with pytest.raises(BackendUnavailable, match=REFUSED):
        backend(server).check()
    assert server.sent() == []  # nothing was sent over the untrusted connection


def test_a_wrong_fingerprint_is_refused(server: FakeElasticsearchServer) -> None:
    with pytest.raises(BackendUnavailable, match=REFUSED):
        backend(server, elasticsearch_ssl_fingerprint="AB:" * 31 + "CD").check()
    assert server.sent() == []


def test_another_ca_is_refused(server: FakeElasticsearchServer, tmp_path: Path) -> None:
    other = private_ca(tmp_path)
    with pytest.raises(BackendUnavailable, match=REFUSED):
        backend(server, elasticsearch_ca_certs=other.ca).check()


@pytest.mark.parametrize("content", [None, "not a certificate\n"])
def test_a_ca_bundle_that_is_missing_or_no_pem_stops_start_up(
    server: FakeElasticsearchServer, tmp_path: Path, content: str | None
) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=r"SIFT_ELASTICSEARCH_CA_CERTS \(.*ca\.pem\)"):
        backend(server, elasticsearch_ca_certs=path)


def test_a_fingerprint_that_is_no_sha256_or_both_settings_stop_start_up(
    server: FakeElasticsearchServer, ca: PrivateCa
) -> None:
    with pytest.raises(ConfigError, match="SIFT_ELASTICSEARCH_SSL_FINGERPRINT: String should"):
        load_settings(elasticsearch_ssl_fingerprint="AB:CD")
    with pytest.raises(ConfigError, match="SIFT_ELASTICSEARCH_CA_CERTS, SIFT_ELASTICSEARCH_SSL"):
        load_settings(elasticsearch_ca_certs=ca.ca, elasticsearch_ssl_fingerprint=ca.fingerprint())


def test_a_trust_setting_with_a_plain_http_url_stops_start_up(ca: PrivateCa) -> None:
    """The client refuses TLS options for an ``http://`` node (a bare ValueError, before)."""
    http = "http://127.0.0.1:9200"
    with pytest.raises(ConfigError, match="SIFT_ELASTICSEARCH_CA_CERTS needs an https://"):
        load_settings(elasticsearch_url=http, elasticsearch_ca_certs=ca.ca)
    with pytest.raises(ConfigError, match="SIFT_ELASTICSEARCH_SSL_FINGERPRINT needs an https://"):
        load_settings(elasticsearch_url=http, elasticsearch_ssl_fingerprint=ca.fingerprint())
