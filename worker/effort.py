"""Which models take ``output_config.effort``, and at which levels (Anthropic's "Effort" page
and the ``anthropics/skills`` claude-api reference, "Thinking & Effort").

Shared by the settings, which refuse at start an effort level the model is known to refuse
(each of its calls would be a 400), and the reranker, which sends the level.
"""

from __future__ import annotations

# The model-id families that accept ``output_config.effort`` (Opus 4.5 and later, Sonnet 4.6
# and later, Mythos, Fable), each with its dated ids (``claude-opus-4-5-20251101``).
EFFORT_MODELS = (
    "claude-opus-4-5",
    "claude-opus-4-6",
    "claude-opus-4-7",
    "claude-opus-4-8",
    "claude-opus-5",
    "claude-sonnet-4-6",
    "claude-sonnet-5",
    "claude-haiku-5-5",
    "claude-mythos",
    "claude-fable",
)
# Families known to answer 400 ``invalid_request_error`` to any effort. A model in neither
# table (one newer than them) is sent the level it is given.
NO_EFFORT_MODELS = (
    "claude-haiku-4-5",
    "claude-sonnet-4-5",
    "claude-sonnet-4-0",
    "claude-opus-4-1",
    "claude-opus-4-0",
    "claude-3",
)
# Families that take some levels only: Opus 4.5 predates max and xhigh, and xhigh came with
# Opus 4.7. Every other family of EFFORT_MODELS takes every level.
EFFORT_LEVELS: dict[str, tuple[str, ...]] = {
    "claude-opus-4-5": ("low", "medium", "high"),
    "claude-opus-4-6": ("low", "medium", "high", "max"),
    "claude-sonnet-4-6": ("low", "medium", "high", "max"),
}


def _of(model: str, family: str) -> bool:
    return model == family or model.startswith(family + "-")


def effort_for(model: str, setting: str | None) -> str | None:
    """The ``output_config.effort`` to send ``model`` for ``SIFT_GENERATION_EFFORT=setting``.

    ``auto`` is ``low`` (the lowest level, DESIGN.md §7) for a model of :data:`EFFORT_MODELS`
    and nothing for any other; a level is sent as it is, to any model (a model newer than the
    table); None (the variable empty, or ``none``) sends nothing.

    >>> effort_for("claude-haiku-4-5", "auto"), effort_for("claude-sonnet-4-6", "auto")
    (None, 'low')
    """
    if setting != "auto":
        return setting
    return "low" if any(_of(model, family) for family in EFFORT_MODELS) else None


def refused_effort(model: str, setting: str | None) -> str | None:
    """Why ``model`` is known to refuse the effort ``setting`` sends it (None: not known to).

    >>> refused_effort("claude-haiku-4-5", "high")
    'claude-haiku-4-5 takes no effort level'
    >>> refused_effort("claude-sonnet-4-6", "xhigh")
    'claude-sonnet-4-6 takes low, medium, high or max'
    >>> refused_effort("claude-haiku-4-5", "auto"), refused_effort("claude-opus-4-7", "xhigh")
    (None, None)
    """
    effort = effort_for(model, setting)
    if effort is None:
        return None
    if any(_of(model, family) for family in NO_EFFORT_MODELS):
        return f"{model} takes no effort level"
    for family, levels in EFFORT_LEVELS.items():
        if _of(model, family) and effort not in levels:
            return f"{model} takes {', '.join(levels[:-1])} or {levels[-1]}"
    return None
