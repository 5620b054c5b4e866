"""A long document is tokenized from its head only, and gets the vector its whole text gives.

The model reads a text's first 256 tokens. Tokenizing a whole 100,000-character document
made every further 256-token window too (131 of them), about 5 MB a text, all thrown away;
a 256-document chunk of them left a worker process 1.3 GB larger. The embedder now hands
the tokenizer a head of each text cut at a word boundary, and takes its ids only when the
head itself ran past the cap (else a longer head). These tests spy on the real tokenizer
(what it was handed) and compare ids and vectors, on real MiniLM, with and without the cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from worker.adapters.embedder import MAX_TOKENS, OnnxMiniLMEmbedder, token_head

WORDS = "the rate at which green tea releases catechins depends on water temperature and time"


class SpyTokenizer:
    """The real tokenizer, noting the longest text and the most texts it was handed at once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.longest = 0
        self.widest = 0

    def encode_batch(self, texts: Sequence[str]) -> Any:
        self.longest = max([self.longest, *map(len, texts)])
        self.widest = max(self.widest, len(texts))
        return self.inner.encode_batch(texts)


def long_texts() -> dict[str, str]:
    """Texts far past 256 tokens, each testing one way a cut could change the tokens."""
    prose = (WORDS + ". ") * 1200
    return {
        "prose": prose,
        # one "word" of 3,000 characters (a single [UNK]) before the 256th token, so the
        # first head holds few tokens and a longer one is needed
        "long word": "start " + "x" * 3000 + " " + prose,
        # an unbroken run of CJK ideographs: each its own word, no space anywhere
        "cjk": "绿茶的温度与时间决定了茶多酚的释放速度" * 5000,
        # more spaces than characters: the first heads hold few tokens
        "spaces": " " * 9000 + "tea" + (" " * 40 + "leaf") * 2000,
        "punctuation": "!?-" * 30000,
        "accents and tabs": ("Crème brûlée\tcafé\nnaïve résumé\r" + "e\u0301 ") * 4000,
        # one [UNK] word of 120,000 characters first: no boundary until past it
        "unbroken latin": "abc" * 40000 + " " + prose,
    }


@pytest.fixture(scope="module")
def embedder() -> OnnxMiniLMEmbedder:
    return OnnxMiniLMEmbedder(threads=1)


def test_a_long_document_is_tokenized_from_its_head_only(embedder: OnnxMiniLMEmbedder) -> None:
    text = (WORDS + ". ") * 1200  # 104,400 characters, ~20,000 tokens
    tokenizer, _ = embedder._load()
    spy = SpyTokenizer(tokenizer)
    embedder._tokenizer = spy
    try:
        vectors = embedder.embed_array([f"doc {i} {text}" for i in range(40)])
    finally:
        embedder._tokenizer = tokenizer
    assert vectors.shape == (40, embedder.dimension)
    assert 0 < spy.longest < len(text) // 10, spy.longest
    assert spy.widest <= 32, spy.widest  # tokenized a few texts at a time, not a whole chunk


@pytest.mark.parametrize("name", list(long_texts()))
def test_a_long_texts_vector_is_the_same_with_and_without_the_cut(
    embedder: OnnxMiniLMEmbedder, name: str
) -> None:
    text = long_texts()[name]
    tokenizer, _ = embedder._load()
    whole = tokenizer.encode(text)
    assert len(whole.ids) == MAX_TOKENS
    assert embedder.token_ids([text]) == [whole.ids]
    uncut = OnnxMiniLMEmbedder(threads=1, head_chars=None)
    assert np.array_equal(embedder.embed_array([text]), uncut.embed_array([text]))


def test_a_head_ends_at_a_word_boundary_past_its_length() -> None:
    assert token_head("tea leaf water", 5) == "tea leaf"
    assert token_head("tea leaf water", 3) == "tea"  # a boundary at the length itself
    assert token_head("tea leaf, water", 6) == "tea leaf"
    assert token_head("绿茶的温度", 2) == "绿茶"
    assert token_head("x" * 50, 10) == "x" * 50  # no boundary past it: the whole text
    assert token_head("short", 100) == "short"


def test_a_cut_inside_a_word_would_change_the_tokens(embedder: OnnxMiniLMEmbedder) -> None:
    """What the boundary is for (so the checks above can fail): a head cut inside a long word
    near the cap runs past the cap too, but its pieces of the word are not the [UNK] the
    whole word is."""
    tokenizer, _ = embedder._load()
    start = "tea " * 250
    text = start + "x" * 150 + " leaf" * 100
    whole = tokenizer.encode(text).ids
    inside = tokenizer.encode(text[: len(start) + 60]).ids
    assert len(inside) == MAX_TOKENS
    assert inside != whole
    assert token_head(text, len(start) + 60) == start + "x" * 150  # short of the cap: retried
    assert OnnxMiniLMEmbedder(head_chars=len(start) + 60).token_ids([text]) == [whole]
