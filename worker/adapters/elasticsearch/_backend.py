"""The Elasticsearch backend itself: the parts of this package in one class, built from
the settings, and the check and migration of the shared layout of earlier releases
(:mod:`worker.adapters.elasticsearch._migrate`)."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

from elasticsearch import Elasticsearch

from worker.adapters.elasticsearch._drops import _Drops
from worker.adapters.elasticsearch._listing import _Listing
from worker.adapters.elasticsearch._mapping import FieldNames, IndexSettings
from worker.adapters.elasticsearch._migrate import SharedLayout
from worker.adapters.elasticsearch._reindex import _Reindex
from worker.adapters.elasticsearch._settings import _Settings
from worker.adapters.elasticsearch._writes import _Writes
from worker.errors import ConfigError

if TYPE_CHECKING:
    from worker.settings import Settings


class ElasticsearchBackend(_Writes, _Drops, _Listing, _Reindex, _Settings):
    """A SearchBackend over an Elasticsearch 9.x cluster (see the package docstring)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ElasticsearchBackend:
        """Build the client (no network call yet) with its own retries off."""
        if not settings.elasticsearch_url:
            raise ConfigError("SIFT_SEARCH_BACKEND=elasticsearch needs SIFT_ELASTICSEARCH_URL")
        client = Elasticsearch(
            settings.elasticsearch_url,
            api_key=settings.elasticsearch_api_key,
            **_trust(settings),
            request_timeout=settings.elasticsearch_request_timeout,
            max_retries=0,
            retry_on_status=(),
            retry_on_timeout=False,
        )
        return cls(
            client,
            prefix=settings.elasticsearch_index_prefix,
            fields=FieldNames(
                id=settings.elasticsearch_id_field,
                text=settings.elasticsearch_text_field,
                title=settings.elasticsearch_title_field,
                vector=settings.elasticsearch_vector_field,
                tenant=settings.elasticsearch_tenant_field,
                revision=settings.elasticsearch_revision_field,
                metadata=settings.elasticsearch_metadata_field,
                model=settings.elasticsearch_model_field,
                metadata_terms=settings.elasticsearch_metadata_terms_field,
                write_version=settings.elasticsearch_write_version_field,
            ),
            index_settings=IndexSettings(
                dims=settings.elasticsearch_vector_dims,
                quantization=settings.elasticsearch_vector_quantization,
                shards=settings.elasticsearch_shards,
                replicas=settings.elasticsearch_replicas,
                gc_deletes_seconds=settings.elasticsearch_gc_deletes_seconds,
                analyzer=settings.elasticsearch_analyzer,
            ),
            num_candidates=settings.elasticsearch_num_candidates,
            refresh=settings.elasticsearch_refresh,
            request_timeout=settings.elasticsearch_request_timeout,
            bulk_chunk_size=settings.elasticsearch_bulk_chunk_size,
            native_rrf=settings.elasticsearch_native_rrf,
            max_indexes_per_tenant=settings.max_indexes_per_tenant,
        )

    def check(self) -> None:
        """Refuse to run over the shared layout's indexes (:meth:`SharedLayout.check`)."""
        SharedLayout(self).check()

    def shared_layout(self) -> dict[str, list[str]]:
        """The shared layout's aliases and their concrete indexes (:meth:`SharedLayout.find`)."""
        return SharedLayout(self).find()

    def migrate_shared(
        self, *, delete_old: bool = False, dry_run: bool = False
    ) -> dict[str, dict[str, int]]:
        """Copy the shared layout into per-tenant indexes (:meth:`SharedLayout.migrate`)."""
        return SharedLayout(self).migrate(delete_old=delete_old, dry_run=dry_run)


def _trust(settings: Settings) -> dict[str, Any]:
    """The client's TLS trust: a private CA's PEM bundle (read now, so a bad one stops
    start-up naming its variable, not every request), or a pinned certificate fingerprint;
    nothing: the client's default roots."""
    ca = settings.elasticsearch_ca_certs
    if ca is not None:
        try:
            ssl.create_default_context(cafile=str(ca))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"SIFT_ELASTICSEARCH_CA_CERTS ({ca}): {exc}") from exc
        return {"ca_certs": str(ca)}
    if settings.elasticsearch_ssl_fingerprint:
        return {"ssl_assert_fingerprint": settings.elasticsearch_ssl_fingerprint}
    return {}
