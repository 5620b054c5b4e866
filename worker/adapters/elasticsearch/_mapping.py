"""What an index of Sift's looks like in Elasticsearch: where each part of a document lives
(:class:`FieldNames`, settable so an existing index can be searched), how a new concrete
index is built (:class:`IndexSettings`) and the index template that maps it
(:func:`index_template`). Pure: no request is made here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class FieldNames:
    """Where each part of a Sift document lives in the ES index (settable for existing ones)."""

    id: str = "doc_id"
    text: str = "text"
    title: str = "title"  # "" when the index has no title field
    vector: str = "vector"
    tenant: str = "tenant"
    revision: str = "revision"
    metadata: str = "metadata"
    model: str = "embedding_model"  # "" when the index records no embedding model
    # a keyword of typed tokens ``key=n:5`` per metadata value, what filters match;
    # "" when the index has none (filters then compare the metadata field as text)
    metadata_terms: str = "metadata_terms"
    # a ``long``: the write version of the ingest that wrote the document, so a drop deletes
    # only what was written before it; "" when the index has none (a drop then deletes the
    # tenant's index whole, newer documents included)
    write_version: str = "write_version"

    def source(self) -> list[str]:
        """The ``_source`` fields a hit needs; the vector is never fetched."""
        names = [self.id, self.text, self.title, self.revision, self.metadata, self.tenant]
        return [name for name in names if name]


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How new concrete indexes are built."""

    dims: int = 384
    quantization: str = "int8_hnsw"
    shards: int = 1
    replicas: int = 1
    #: ``index.gc_deletes``: how long a delete's tombstone refuses an older upsert. ES's 60 s
    #: default is far shorter than the broker's redelivery window: an ingest accepted before
    #: a delete, whose worker died after taking it, would be written back when redelivered.
    gc_deletes_seconds: int = 27_000
    #: The analyzer of the text and title fields (``SIFT_ELASTICSEARCH_ANALYZER``): BM25
    #: matches what it makes of the query against what it made of each document, so an
    #: index keeps the one it was made with (ES refuses to change a field's analyzer).
    analyzer: str = "english"


def index_template(prefix: str, fields: FieldNames, index: IndexSettings) -> dict[str, Any]:
    """The body of ``PUT _index_template/<prefix>sift``: Sift's mapping for every new index."""
    properties: dict[str, Any] = {
        fields.id: {"type": "keyword"},
        fields.text: {"type": "text", "analyzer": index.analyzer},
        fields.vector: {
            "type": "dense_vector",
            "dims": index.dims,
            "index": True,
            "similarity": "cosine",
            "index_options": {"type": index.quantization},
        },
        fields.tenant: {"type": "keyword"},
        fields.revision: {"type": "keyword"},
        fields.metadata: {"type": "flattened"},
    }
    if fields.title:
        properties[fields.title] = {"type": "text", "analyzer": index.analyzer}
    if fields.model:
        properties[fields.model] = {"type": "keyword"}
    if fields.metadata_terms:
        properties[fields.metadata_terms] = {"type": "keyword"}
    if fields.write_version:
        properties[fields.write_version] = {"type": "long"}
    return {
        "index_patterns": [f"{prefix}*"],
        # ES refuses two templates with overlapping patterns and equal priorities; a longer
        # prefix ("sift-staging-" inside "sift-*") is more specific, so it ranks higher.
        "priority": 100 + len(prefix),
        "template": {
            "settings": {
                "number_of_shards": index.shards,
                "number_of_replicas": index.replicas,
                "index.gc_deletes": f"{index.gc_deletes_seconds}s",
            },
            # Each index Sift makes says so: the start-up check and the migration of the
            # shared layout go by it, never by a name alone.
            "mappings": {
                "dynamic": "strict",
                "_meta": {"sift": {"layout": "per-tenant", "prefix": prefix}},
                "properties": properties,
            },
        },
        "_meta": {"managed_by": "sift"},
    }
