"""``sift eval``'s three sources and its report: the in-process run over the runtime
(``--corpus``), the batches through the gateway (``--index``), a batch's results file
(``--results``); each gives the report :func:`_print_report` prints. Imported by the command
when it runs (:mod:`worker.cli.evaluate`)."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from worker.adapters.embedded import SCHEMA_VERSION
from worker.adapters.int8_graph import GRAPH_REVISION
from worker.cli._common import EXIT_ITEMS_FAILED, _err
from worker.cli._eval_runs import (
    _check_index,
    _index_written,
    _judged,
    _run_batches,
    _served_window,
    console,
)
from worker.cli._output import format_cost, plain, progress_bar
from worker.evaluation.harness import TENANT, evaluate
from worker.evaluation.inputs import (
    Collection,
    absent_queries,
    read_corpus,
    read_qrels,
    read_results,
)
from worker.evaluation.scoring import eval_runs, score_runs
from worker.evaluation.served import (
    add_usage,
    billed_usage,
    failure_type,
    fallback_reason,
    score_results,
)
from worker.runtime.inprocess import Runtime, build_runtime
from worker.settings import load_settings

EXIT_USAGE = 2


def _ingest(runtime: Runtime, corpus: Path, index: str, tenant: str) -> int:
    documents = read_corpus(corpus)
    with progress_bar() as bar:
        task = bar.add_task(f"indexing {corpus.name}", total=len(documents))
        return runtime.ingest(index, tenant, documents, lambda n: bar.advance(task, n))


def _sha256(path: Path) -> str:
    """The file's sha256, read in chunks (a corpus may not fit in memory)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _usage_error(message: str) -> typer.Exit:
    _err().print(f"[red]error:[/red] {plain(message)}", soft_wrap=True)
    return typer.Exit(EXIT_USAGE)


def _in_process(
    corpus: Path,
    queries: Path,
    qrels: Path,
    data_dir: Path | None,
    window: int | None,
    rerank: bool,
    max_queries: int | None,
) -> dict[str, Any]:
    # the corpus's model calls already run one per core (one onnxruntime thread each, as in
    # a worker): more threads per call would only spin against them
    # the queries and qrels are read and checked before the corpus is indexed
    total = len(_judged(queries, qrels, read_qrels(qrels), max_queries))
    overrides: dict[str, Any] = {}
    if rerank:
        overrides["rerank_enabled"] = True
    settings = load_settings(**overrides)
    # a cache per corpus contents, embedding graph and index schema: an edited corpus is
    # indexed again, vectors of two graphs must never mix, and a data dir of an older schema
    # is refused (it is made again instead)
    digest = _sha256(corpus)
    graph = "int8-matmul" if settings.embedding_int8_compute else "fp32"
    key = f"{digest}|{graph}|{GRAPH_REVISION}|{SCHEMA_VERSION}"
    key = hashlib.sha256(key.encode()).hexdigest()[:12]
    directory = data_dir or Path(".sift/eval") / key
    settings = settings.model_copy(update={"data_dir": directory})
    try:  # the backend makes it; its OSError (a path under a file) was a traceback
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        hint = "give another" if data_dir else "run it where you may write, or give --data-dir"
        raise _usage_error(
            f"--data-dir {directory}: cannot make it ({exc.strerror or exc}); {hint}"
        ) from None
    runtime = build_runtime(settings)
    complete = directory / "indexed.ok"  # written only after the whole corpus is in
    if not complete.exists():
        _ingest(runtime, corpus, "eval", TENANT)
        complete.write_text(f"{corpus.resolve()} sha256:{digest}\n")
    elif f"sha256:{digest}" not in complete.read_text():  # a --data-dir of other contents
        raise _usage_error(
            f"--data-dir {directory} holds the index of other contents than {corpus} "
            "(an older version of it, or another corpus): give a new directory"
        )
    with progress_bar() as bar:
        tasks: dict[str, Any] = {}

        def advance(run: str, n: int) -> None:
            if run not in tasks:
                tasks[run] = bar.add_task(f"run {run}", total=total)
            bar.advance(tasks[run], n)

        return evaluate(
            runtime,
            Collection(corpus, queries, qrels),
            window=window,
            rerank=rerank,
            max_queries=max_queries,
            progress=advance,
        )


def _served(
    index: str,
    queries_path: Path,
    qrels_path: Path,
    out: Path | None,
    window: int | None,
    rerank: bool,
    max_queries: int | None,
) -> dict[str, Any]:
    """Each run as one batch through the gateway (the runs of the in-process evaluation, the
    same modes, depths and rerank choice), then scored from the hits the API returned. The
    window is ``window``, else the one a traced search of the index says it uses."""
    qrels = read_qrels(qrels_path)
    queries = _judged(queries_path, qrels_path, qrels, max_queries)
    before = _check_index(index)
    window = window or _served_window(index, queries[0][1])
    runs = eval_runs(rerank, window)
    rankings: dict[str, dict[str, list[str]]] = {}
    usage: dict[str, float | None] = {}
    errors: Counter[str] = Counter()
    fallbacks: Counter[str] = Counter()  # reranked searches served the fused order
    failed: dict[str, set[str]] = {}  # by run, the queries whose search did not succeed
    submitted, served = _run_batches(index, runs, queries, out)
    written = _index_written(index, before)
    for run in runs:
        rankings[run.name] = {}
        failed[run.name] = set()
        for item in served[run.name]:
            result = item.get("result") if item.get("status") == "succeeded" else None
            if result is None:
                failed[run.name].add(str(item["query_id"]))
                errors[failure_type(item)] += 1
            if run.rerank and (reason := fallback_reason(result)):
                fallbacks[reason] += 1
            hits = (result or {}).get("hits") or []
            rankings[run.name][str(item["query_id"])] = [str(hit["id"]) for hit in hits]
            add_usage(usage, billed_usage(item))  # a failed or canceled item's billed calls too
    report = score_runs(rankings, runs, qrels, queries, window, failed)
    report["failed_by_run"] = {name: len(ids) for name, ids in failed.items()}
    report["failed"] = sum(report["failed_by_run"].values())
    report["errors"] = dict(errors.most_common())
    report["rerank_fallbacks"] = dict(fallbacks.most_common())
    report["missing"] = absent_queries(queries_path, qrels)
    report["missing_from"] = str(queries_path)
    report["usage"] = usage
    report["batches"] = submitted
    report["index_written"] = (
        written and f"index {index!r} was written while the runs went: {written}"
    )
    return report


def _scored_file(results: Path, qrels: Path, window: int | None) -> dict[str, Any]:
    report = score_results(read_results(results), read_qrels(qrels), window=window)
    if not report["queries"]:
        raise ValueError(f"{results}: no result is for a query in {qrels}")
    return report


def _print_report(report: dict[str, Any]) -> None:
    table = Table(title=f"{report['queries']} queries; judge: {report['judge']}")
    measures = list(next(iter(report["runs"].values())))
    depth = report.get("depth") or {}
    table.add_column("run")
    for measure in measures:  # ir-measures' RR@10, averaged over the queries, is MRR@10
        table.add_column("MRR@10" if measure == "RR@10" else measure, justify="right")
    table.add_column("depth", justify="right")
    lower = report.get("lower_bounds") or {}
    for name, values in report["runs"].items():
        ranked = depth.get(name)
        table.add_row(
            name,
            *(_figure(values[m], m in lower.get(name, ())) for m in measures),
            "" if ranked is None else str(ranked),
        )
    console.print(table)
    if report.get("judged_hits") == 0:
        console.print(
            "[yellow]no hit of any run is a document the qrels judge[/]: are these the "
            "results (or the index) of the collection the qrels are for?",
            soft_wrap=True,
        )
    for reason in (report.get("unknown") or {}).values():
        console.print(f"[yellow]–: unknown[/]: {reason}", soft_wrap=True)
    if any(lower.values()):
        console.print(
            "≥: a lower bound: the run stops where the results stop holding its ranks (its "
            "depth), so a measure past it counts only what they hold",
            soft_wrap=True,
        )
    recall = report["candidate_recall"]
    reached = recall["queries_with_a_relevant_candidate"]
    bounds = recall.get("lower_bound") or ()  # results cut before the window
    end_to_end = _figure(recall["end_to_end"], "end_to_end" in bounds)
    at_least = "≥" if "queries_with_a_relevant_candidate" in bounds else ""
    console.print(
        f"candidate recall@{recall['window']} (end-to-end): {end_to_end}; "
        f"queries with a relevant candidate in the window: "
        f"{'–' if reached is None else f'{at_least}{reached}'}/{report['queries']}"
    )
    by_ranking = recall.get("by_ranking") or {}
    if len(by_ranking) > 1:
        # a lower bound where the results stop holding a run's ranks before the window
        window = recall["window"]
        cut = {
            name for name, bounds in lower.items() if bounds and depth.get(name, window) < window
        }
        console.print(
            f"candidate recall@{recall['window']} by ranking: "
            + ", ".join(
                f"{name} {_figure(value, name in cut)}" for name, value in by_ranking.items()
            )
        )
    for name, versus in (report.get("fusion_vs_channels") or {}).items():
        compared = versus.get("queries", report["queries"])
        console.print(
            f"{name} per query (nDCG@10) vs the better channel on that query: "
            f"{_shares(versus['vs_better_channel_per_query'])}; vs {versus['best_channel']} "
            f"(better on average): {_shares(versus['vs_best_channel'])}"
            + (
                f" (on the {compared} of {report['queries']} queries it and both channels answered)"
                if compared < report["queries"]
                else ""
            )
        )
        # a run with failed searches is below for them (they score 0), not for its fusion;
        # nor is one of an index written meanwhile (it may have read another state of it)
        failed = (report.get("failed_by_run") or {}).get(name)
        if versus["hurts"] and not failed and not report.get("index_written"):
            console.print(
                f"[yellow]fusion hurts here: {name} {versus['ndcg@10']:.3f} < "
                f"{versus['best_channel']} alone {versus['best_channel_ndcg@10']:.3f}[/]; "
                "`sift eval --tune` chooses weights on your judgments"
            )
    if recall.get("approximated"):
        console.print(f"[yellow]candidate recall@{recall['window']} is {recall['approximated']}[/]")
    held = recall.get("candidates_held", recall["window"])
    if held < recall["window"] and recall["end_to_end"] is not None:
        console.print(
            f"[yellow]the results hold only {held} fused candidate(s) for some query[/]: "
            f"candidate recall counts those, not {recall['window']}"
        )
    shallow = [name for name, ranked in depth.items() if ranked < 100]
    if shallow:
        console.print(
            f"depth: the fewest documents a run ranked for a query ({', '.join(shallow)}: "
            "under 100). A run ranks fewer when fewer documents match, or when the results "
            "were cut (a batch's limit); a measure past its depth counts only what was ranked."
        )
    if report.get("failed"):
        why = ", ".join(f"{plain(kind)} {n}" for kind, n in (report.get("errors") or {}).items())
        runs = ", ".join(
            f"{name} {n}" for name, n in (report.get("failed_by_run") or {}).items() if n
        )
        console.print(
            f"[red]{report['failed']} search(es) did not succeed"
            + (f" ({why})" if why else "")
            + f"[/]; they score 0 (by run: {runs}); exit {EXIT_ITEMS_FAILED}",
            soft_wrap=True,
        )
    if fallbacks := report.get("rerank_fallbacks"):
        why = ", ".join(f"{plain(reason)} {n}" for reason, n in fallbacks.items())
        console.print(
            f"[yellow]{sum(fallbacks.values())} reranked search(es) fell back to the fused "
            f"order ({why})[/]: the model's answer was not used, so the final (reranked) row "
            "scores their fused order, as served",
            soft_wrap=True,
        )
    if report.get("index_written"):
        console.print(
            f"[red]{plain(report['index_written'])}[/]: the runs may have read different "
            "states of it, so their figures do not compare; evaluate again while nothing "
            f"writes it; exit {EXIT_ITEMS_FAILED}",
            soft_wrap=True,
        )
    if report.get("missing") and report.get("missing_from"):
        console.print(
            f"[yellow]{report['missing']} judged quer(y/ies) of the qrels are not in "
            f"{plain(report['missing_from'])}[/]: left out of every figure",
            soft_wrap=True,
        )
    elif report.get("missing"):
        console.print(
            f"[yellow]{report['missing']} judged quer(y/ies) of the qrels have no line in the "
            "results[/]: left out of every figure (a file cut short, or a batch of other "
            "queries)"
        )
    _print_usage(report.get("usage") or {}, console)


def _print_usage(usage: dict[str, Any], out: Console) -> None:
    """The rerank usage line, when any model call was made: under the report, or before the
    error of a failed search that stopped an in-process evaluation."""
    if usage.get("requests"):
        out.print(
            f"rerank usage: {int(usage['requests'])} requests, "
            f"{int(usage['input_tokens'])} input / {int(usage['output_tokens'])} output tokens, "
            f"{format_cost(usage.get('cost_usd', 0.0))}"
        )


def _figure(value: float | None, lower_bound: bool = False) -> str:
    """A figure as the table shows it: ``–`` unknown, ``≥`` a lower bound.

    >>> _figure(None), _figure(0.5), _figure(0.25, lower_bound=True)
    ('–', '0.500', '≥0.250')
    """
    if value is None:
        return "–"
    return f"{'≥' if lower_bound else ''}{value:.3f}"


def _shares(shares: dict[str, float]) -> str:
    return f"lost {shares['lost']:.1%}, won {shares['won']:.1%}, tied {shares['tied']:.1%}"
