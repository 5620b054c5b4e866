"""A prompt's input tokens, estimated before it is sent (no tokenizer: a rate of characters)."""

from __future__ import annotations

import json

from worker.core.types import RerankPrompt

# about Claude's rate on English text and under it on code: an estimate that starts high
CHARS_PER_TOKEN = 3.0


def prompt_tokens(prompt: RerankPrompt, chars_per_token: float = CHARS_PER_TOKEN) -> float:
    """The input tokens of ``prompt`` (its system text, user text and output schema), before
    any correction learned from what the provider reported: ASCII characters over
    ``chars_per_token``, and a token for every other character (Japanese or Chinese text is
    about a token a character), so the estimate is high rather than low in any language."""
    schema = json.dumps(dict(prompt.output_schema), separators=(",", ":"))
    return sum(_tokens(text, chars_per_token) for text in (prompt.system, prompt.user, schema))


def _tokens(text: str, chars_per_token: float) -> float:
    """
    >>> _tokens("abcdef", 3.0), _tokens("ab茶", 2.0)
    (2.0, 2.0)
    """
    if text.isascii():  # a flag of the string: no pass over it
        return len(text) / chars_per_token
    ascii_chars = len(text.encode("ascii", "ignore"))
    return ascii_chars / chars_per_token + (len(text) - ascii_chars)
