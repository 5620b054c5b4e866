"""Prompt and answer tokens of Sift's listwise prompt against RankGPT's, on the same 30 candidates.

Targets: Sift's input tokens at most 0.6x RankGPT's, its answer tokens at most 0.2x.

Both prompts go through the real ``anthropic`` SDK to the fake Messages API
(``tests/fake_anthropic.py``) over loopback HTTP, and the tokens are read from each response's
``usage``, so both sides are counted by the same tokenizer (MiniLM's WordPiece; a real Claude
tokenizer gives other absolute numbers, and the ratios are what this measures). Thinking is
excluded for both (the fake's thinking allowance is 0): output tokens are the answer alone.

- **Sift** (``listwise.v2``): one call, ``worker.core.policy.build_prompt`` with k=10 and
  1,200 characters per candidate, sent by ``AnthropicReranker``; the answer is
  ``{"positions": [...]}`` with 10 positions.
- **RankGPT** (Sun et al. 2023, ``rank_gpt.py``): a sliding window of 20, step 10, back to
  front, so two calls for 30 candidates. Each passage is its own user turn ``[i] passage``
  answered by an assistant turn ``Received passage [i].``, cut to 300 words; the answer is a
  full permutation of the window, ``[20] > [19] > ... > [1]``. The system prompt is sent as
  Anthropic's ``system``.

Candidates are SciFact's BM25 top 30 per query, from Sift's own embedded backend, for the
first ``--queries`` queries.
The data is read where it lies and never copied into the repository.

    python benchmarks/bench_prompt_tokens.py [--scifact ../shared/data/scifact] [--queries 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).absolute().parents[1]
if str(ROOT) not in sys.path:  # run as a file: make ``worker`` and ``tests`` importable
    sys.path.insert(0, str(ROOT))

import anthropic  # noqa: E402

from tests.fake_anthropic import FakeAnthropic  # noqa: E402
from worker.adapters.anthropic import AnthropicReranker  # noqa: E402
from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.core.policy import build_prompt  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402

MODEL = "claude-haiku-4-5"
CANDIDATES = 30
K = 10
MAX_CHARS = 1200
THINKING_TOKENS = 1024
TOKENS_PER_POSITION = 8
WINDOW, STEP, RANKGPT_MAX_WORDS = 20, 10, 300
RANKGPT_MAX_TOKENS = 4096

RANKGPT_SYSTEM = (
    "You are RankGPT, an intelligent assistant that can rank passages based on their "
    "relevancy to the query."
)


@dataclass(frozen=True, slots=True)
class Doc:
    id: str
    title: str
    text: str


@dataclass(slots=True)
class Tally:
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, usage: Any) -> None:
        self.calls += 1
        self.input_tokens += usage.input_tokens + (usage.cache_read_input_tokens or 0)
        self.input_tokens += usage.cache_creation_input_tokens or 0
        self.output_tokens += usage.output_tokens


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def bm25_candidates(corpus: list[Doc], queries: list[str], n: int) -> list[list[Doc]]:
    """BM25 top ``n`` per query from Sift's own embedded backend, in a temporary directory."""
    by_id = {doc.id: doc for doc in corpus}
    with tempfile.TemporaryDirectory(prefix="sift-bench-") as tmp:
        backend = EmbeddedBackend(Path(tmp))
        backend.upsert(
            "bench", "bench", [Document(d.id, d.text, d.title, "1") for d in corpus], None
        )
        pools = []
        for query in queries:
            found = backend.retrieve(
                ChannelQuery("bench", HardFilters("bench"), ("bm25",), n, query)
            ).hits["bm25"]
            pool = [by_id[hit.document.id] for hit in found]
            pool += [doc for doc in corpus if doc not in pool][: n - len(pool)]  # pad rare misses
            pools.append(pool)
        backend.close()
    return pools


def rankgpt_messages(query: str, window: Sequence[Doc]) -> list[dict[str, str]]:
    """RankGPT's ``create_permutation_instruction``, with the system turn moved to ``system``."""
    num = len(window)
    messages = [
        {
            "role": "user",
            "content": f"I will provide you with {num} passages, each indicated by number "
            f"identifier []. \nRank the passages based on their relevance to query: {query}.",
        },
        {"role": "assistant", "content": "Okay, please provide the passages."},
    ]
    for rank, doc in enumerate(window, start=1):
        content = f"{doc.title} Content: {doc.text}".strip()
        content = " ".join(content.split()[:RANKGPT_MAX_WORDS])
        messages.append({"role": "user", "content": f"[{rank}] {content}"})
        messages.append({"role": "assistant", "content": f"Received passage [{rank}]."})
    messages.append(
        {
            "role": "user",
            "content": f"Search Query: {query}. \nRank the {num} passages above based on their "
            "relevance to the search query. The passages should be listed in descending order "
            "using identifiers. The most relevant passages should be listed first. The output "
            "format should be [] > [], e.g., [1] > [2]. Only response the ranking results, do "
            "not say any word or explain.",
        }
    )
    return messages


def windows(n: int) -> list[tuple[int, int]]:
    """RankGPT's sliding windows over ``n`` candidates, back to front: [(start, end), ...]."""
    spans = []
    end = n
    while True:
        start = max(0, end - WINDOW)
        spans.append((start, end))
        if start == 0:
            return spans
        end -= STEP


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scifact", type=Path, default=ROOT.parent / "shared/data/scifact")
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument(
        "--message-overhead",
        type=int,
        default=4,
        help="tokens the fake adds per message for role framing (0 counts text only)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

    corpus = [
        Doc(str(d["_id"]), d.get("title", ""), d.get("text", ""))
        for d in read_jsonl(args.scifact / "corpus.jsonl")
    ]
    queries = [str(q["text"]) for q in read_jsonl(args.scifact / "queries.jsonl")][: args.queries]
    pools = bm25_candidates(corpus, queries, CANDIDATES)
    source = "BM25 top 30 (Sift's embedded backend)"

    sift, rankgpt = Tally(), Tally()
    with (
        FakeAnthropic(thinking_tokens=0, message_overhead_tokens=args.message_overhead) as fake,
        anthropic.Anthropic(base_url=fake.url, api_key="bench", max_retries=0) as client,
    ):
        reranker = AnthropicReranker(MODEL, client=client)
        for query, pool in zip(queries, pools, strict=True):
            prompt = build_prompt(
                query,
                [(doc.title, doc.text) for doc in pool],
                k=K,
                max_chars=MAX_CHARS,
                thinking_tokens=THINKING_TOKENS,
                tokens_per_position=TOKENS_PER_POSITION,
            )
            reply = reranker.rerank(prompt, timeout_seconds=30.0)
            assert len(reply.positions) == K, reply.positions
            sift.add(reply.usage)
            for start, end in windows(len(pool)):
                message = client.messages.create(
                    model=MODEL,
                    max_tokens=RANKGPT_MAX_TOKENS,
                    system=RANKGPT_SYSTEM,
                    messages=rankgpt_messages(query, pool[start:end]),  # type: ignore[arg-type]
                    timeout=30.0,
                )
                text = "".join(b.text for b in message.content if b.type == "text")
                assert text.count(">") == end - start - 1, text
                rankgpt.add(message.usage)

    n = len(queries)
    rows = {
        "sift": {
            "calls": sift.calls / n,
            "input": sift.input_tokens / n,
            "output": sift.output_tokens / n,
        },
        "rankgpt": {
            "calls": rankgpt.calls / n,
            "input": rankgpt.input_tokens / n,
            "output": rankgpt.output_tokens / n,
        },
    }
    ratios = {
        "input": rows["sift"]["input"] / rows["rankgpt"]["input"],
        "output": rows["sift"]["output"] / rows["rankgpt"]["output"],
    }
    verdict = {"input": ratios["input"] <= 0.6, "output": ratios["output"] <= 0.2}
    if args.json:
        print(
            json.dumps(
                {
                    "queries": n,
                    "candidates": source,
                    "per_query": rows,
                    "ratios": ratios,
                    "targets_met": verdict,
                },
                indent=2,
            )
        )
        return
    print(f"SciFact, {n} queries, candidates: {source}; tokenizer: WordPiece (fake over HTTP);")
    print(f"message overhead {args.message_overhead} tokens; thinking excluded for both.")
    print(f"{'per query':<10}{'calls':>8}{'input tokens':>15}{'output tokens':>15}")
    for name, row in rows.items():
        print(f"{name:<10}{row['calls']:>8.0f}{row['input']:>15.1f}{row['output']:>15.1f}")
    print(
        f"ratio     input {ratios['input']:.3f} (target <= 0.6: "
        f"{'met' if verdict['input'] else 'MISSED'}), output {ratios['output']:.3f} "
        f"(target <= 0.2: {'met' if verdict['output'] else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
