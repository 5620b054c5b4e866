"""``sift eval``: the evaluation harness on the in-process runtime, with no queue."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from worker.adapters.embedder import GRAPH_REVISION
from worker.cli import app
from worker.cli._output import progress_bar
from worker.errors import SiftError
from worker.evaluation import TENANT, Collection, evaluate, read_corpus
from worker.runtime import Runtime, build_runtime
from worker.settings import load_settings

console = Console()


def _ingest(runtime: Runtime, corpus: Path, index: str, tenant: str) -> int:
    documents = read_corpus(corpus)
    with progress_bar(console) as bar:
        task = bar.add_task(f"indexing {corpus.name}", total=len(documents))
        return runtime.ingest(index, tenant, documents, lambda n: bar.advance(task, n))


@app.command("eval")
def eval_command(
    corpus: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="corpus.jsonl")],
    queries: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="queries.jsonl")],
    qrels: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="qrels (tsv or trec)")],
    data_dir: Annotated[
        Path | None, typer.Option(help="index directory; a cache per corpus by default")
    ] = None,
    window: Annotated[int, typer.Option(min=1, help="rerank window for candidate recall")] = 30,
    rerank: Annotated[bool, typer.Option(help="add the reranked run (needs a model)")] = False,
    max_queries: Annotated[int | None, typer.Option(min=1)] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the report")] = None,
) -> None:
    """Evaluate BM25, kNN, fused and final runs in-process with ir-measures."""
    # the corpus's model calls already run one per core (one onnxruntime thread each, as in
    # a worker): more threads per call would only spin against them
    overrides: dict[str, Any] = {}
    if rerank:
        overrides["rerank_enabled"] = True
    try:
        settings = load_settings(**overrides)
        # a cache per corpus and embedding graph: vectors of two graphs must never mix
        graph = "int8-matmul" if settings.embedding_int8_compute else "fp32"
        key = f"{corpus.resolve()}|{graph}|{GRAPH_REVISION}"
        key = hashlib.sha256(key.encode()).hexdigest()[:12]
        directory = data_dir or Path(".sift/eval") / key
        settings = settings.model_copy(update={"data_dir": directory})
        runtime = build_runtime(settings)
        complete = directory / "indexed.ok"  # written only after the whole corpus is in
        if not complete.exists():
            _ingest(runtime, corpus, "eval", TENANT)
            complete.write_text(f"{corpus.resolve()}\n")
        with progress_bar(console) as bar:
            tasks: dict[str, Any] = {}

            def advance(run: str, n: int, total: int) -> None:
                if run not in tasks:
                    tasks[run] = bar.add_task(f"run {run}", total=total)
                bar.advance(tasks[run], n)

            report = evaluate(
                runtime,
                Collection(corpus, queries, qrels),
                window=window,
                rerank=rerank,
                max_queries=max_queries,
                progress=advance,
            )
    except SiftError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from error
    _print_report(report)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


def _print_report(report: dict[str, Any]) -> None:
    table = Table(title=f"{report['queries']} queries; judge: {report['judge']}")
    measures = list(next(iter(report["runs"].values())))
    table.add_column("run")
    for measure in measures:
        table.add_column(measure, justify="right")
    for name, values in report["runs"].items():
        table.add_row(name, *(f"{values[m]:.3f}" for m in measures))
    console.print(table)
    recall = report["candidate_recall"]
    console.print(
        f"candidate recall@{recall['window']} (end-to-end): {recall['end_to_end']:.3f}; "
        f"queries with a relevant candidate in the window: "
        f"{recall['queries_with_a_relevant_candidate']}/{report['queries']}"
    )
    usage = report.get("usage") or {}
    if usage.get("requests"):
        console.print(
            f"rerank usage: {int(usage['requests'])} requests, "
            f"{int(usage['input_tokens'])} input / {int(usage['output_tokens'])} output tokens, "
            f"${usage['cost_usd']:.4f}"
        )
