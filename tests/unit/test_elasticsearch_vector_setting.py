"""SIFT_ELASTICSEARCH_VECTOR_QUANTIZATION with SIFT_ELASTICSEARCH_VECTOR_DIMS is checked when the
settings load: Elasticsearch refuses a ``bbq_hnsw`` field of fewer than 64 dimensions
(``DenseVectorFieldMapper.BBQ_MIN_DIMS``), and would refuse Sift's index template at every
tenant's first write instead."""

from __future__ import annotations

import pytest

from worker.errors import ConfigError
from worker.settings import load_settings


@pytest.mark.parametrize("dims", [1, 32, 63])
def test_bbq_under_64_dimensions_is_a_config_error_naming_both_variables(dims: int) -> None:
    with pytest.raises(
        ConfigError,
        match=r"SIFT_ELASTICSEARCH_VECTOR_QUANTIZATION=bbq_hnsw.*SIFT_ELASTICSEARCH_VECTOR_DIMS",
    ):
        load_settings(elasticsearch_vector_quantization="bbq_hnsw", elasticsearch_vector_dims=dims)


@pytest.mark.parametrize(
    ("quantization", "dims"), [("bbq_hnsw", 64), ("bbq_hnsw", 384), ("int8_hnsw", 3), ("hnsw", 1)]
)
def test_what_elasticsearch_maps_loads(quantization: str, dims: int) -> None:
    settings = load_settings(
        elasticsearch_vector_quantization=quantization, elasticsearch_vector_dims=dims
    )
    assert (settings.elasticsearch_vector_quantization, settings.elasticsearch_vector_dims) == (
        quantization,
        dims,
    )
