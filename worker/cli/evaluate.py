"""``sift eval``: quality with ir-measures, of three sources.

* ``--corpus``: in-process over the runtime, with no queue (it embeds the corpus itself).
* ``--index``: an index already ingested through the API: every run is a batch submitted to
  the gateway, so the queue, the worker and the settings are those of production traffic,
  and nothing is embedded here.
* ``--results``: the JSONL ``sift batch`` wrote, scored from the ranks its results carry.

All three print the same table. With ``--index``, ``--tune`` instead tunes the fusion's
method, weights, rank constant and candidate window on the qrels by k-fold cross-validation
(:mod:`worker.evaluation.tuning`), and ``--apply`` stores the chosen settings on the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from worker.adapters.embedded import SCHEMA_VERSION
from worker.adapters.embedder import GRAPH_REVISION
from worker.cli._app import app
from worker.cli._common import EXIT_INTERRUPTED
from worker.cli._http import (
    FINAL_STATUSES,
    RETRY_SECONDS,
    Gateway,
    GatewayError,
    gateway,
    index_name,
)
from worker.cli._output import cli_console, format_cost, plain, progress_bar
from worker.cli.client._batch import _cancel_outcome
from worker.constants import MAX_LIMIT
from worker.contract import Channel
from worker.errors import SiftError
from worker.evaluation.harness import (
    TENANT,
    Collection,
    RunSpec,
    add_usage,
    eval_runs,
    evaluate,
    judged_queries,
    read_corpus,
    read_qrels,
    read_results,
    score_results,
    score_runs,
)
from worker.evaluation.tuning import (
    CHANNELS,
    DEFAULT,
    Grid,
    Point,
    Ranked,
    TuneReport,
    split_folds,
    tune,
)
from worker.runtime.inprocess import Runtime, build_runtime
from worker.settings import load_settings

console = Console(emoji=False)
EXIT_USAGE = 2
EXIT_REFUSED = 3  # --apply refused: the tuned fusion is below a channel alone
PAGE_SIZE = 500


def _ingest(runtime: Runtime, corpus: Path, index: str, tenant: str) -> int:
    documents = read_corpus(corpus)
    with progress_bar(console) as bar:
        task = bar.add_task(f"indexing {corpus.name}", total=len(documents))
        return runtime.ingest(index, tenant, documents, lambda n: bar.advance(task, n))


def _judged(
    queries: Path, qrels_path: Path, qrels: dict[str, dict[str, int]], max_queries: int | None
) -> list[tuple[str, str]]:
    """The judged queries; ValueError when there is none (every measure would be undefined)."""
    judged = judged_queries(queries, qrels, max_queries)
    if not judged:
        raise ValueError(f"{queries}: no query has a relevant document in {qrels_path}")
    return judged


def _sha256(path: Path) -> str:
    """The file's sha256, read in chunks (a corpus may not fit in memory)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _usage_error(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {plain(message)}")
    return typer.Exit(EXIT_USAGE)


@app.command("eval")
def eval_command(
    qrels: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="qrels (tsv or trec)")],
    corpus: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="corpus.jsonl: index it in-process"),
    ] = None,
    index: Annotated[
        str | None,
        typer.Option(
            callback=index_name, help="an index ingested through the API: search it there"
        ),
    ] = None,
    results: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="RESULTS.jsonl of `sift batch`: score it"),
    ] = None,
    queries: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="queries.jsonl (with --corpus, --index)"),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="--corpus: index directory; a cache per corpus by default")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="--index: keep each run's results here, as `sift batch`")
    ] = None,
    window: Annotated[int, typer.Option(min=1, help="rerank window for candidate recall")] = 30,
    rerank: Annotated[bool, typer.Option(help="add the reranked run (needs a model)")] = False,
    max_queries: Annotated[
        int | None, typer.Option(min=1, help="only the first N judged queries, in file order")
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the report")] = None,
    tune: Annotated[
        bool,
        typer.Option(help="--index: tune the fusion's method, weights, rank constant and window"),
    ] = False,
    folds: Annotated[int, typer.Option(min=2, help="--tune: cross-validation folds")] = 5,
    seed: Annotated[int, typer.Option(help="--tune: the seed of the fold split")] = 0,
    apply: Annotated[
        bool, typer.Option(help="--tune: store the chosen settings on the index")
    ] = False,
) -> None:
    """Evaluate BM25, kNN, fused and final runs with ir-measures: in-process (--corpus), of a
    served index (--index) or of a batch's results (--results)."""
    sources = [name for name, given in (("--corpus", corpus), ("--index", index),
                                        ("--results", results)) if given is not None]  # fmt: skip
    if len(sources) != 1:
        raise _usage_error("give exactly one of --corpus, --index and --results")
    if queries is None and results is None:
        raise _usage_error(f"{sources[0]} needs --queries")
    misplaced = [name for name, given, home in (
        ("--queries", queries is not None, results is None),
        ("--data-dir", data_dir is not None, corpus is not None),
        ("--out", out is not None, index is not None),
        ("--rerank", rerank, results is None),
        ("--max-queries", max_queries is not None, results is None),
        ("--tune", tune, index is not None),
        ("--rerank", rerank, not tune),
        ("--folds", folds != 5, tune),
        ("--seed", seed != 0, tune),
        ("--apply", apply, tune),
    ) if given and not home]  # fmt: skip
    if misplaced:
        if misplaced[0] in ("--folds", "--seed", "--apply"):
            raise _usage_error(f"{misplaced[0]} needs --tune")
        where = "--tune" if misplaced[0] == "--rerank" else sources[0]
        raise _usage_error(f"{misplaced[0]} does not apply to {where}")
    if tune:
        assert index is not None and queries is not None
        _tune_command(index, queries, qrels, out, folds, seed, apply, max_queries, json_out)
        return
    try:
        if corpus is not None and queries is not None:
            report = _in_process(corpus, queries, qrels, data_dir, window, rerank, max_queries)
        elif index is not None and queries is not None:
            report = _served(index, queries, qrels, out, window, rerank, max_queries)
        else:
            assert results is not None
            report = _scored_file(results, qrels, window)
    except SiftError as error:
        console.print(f"[red]error:[/red] {plain(error)}")
        raise typer.Exit(2) from error
    except (GatewayError, ValueError) as error:
        console.print(f"[red]error:[/red] {plain(error)}", soft_wrap=True)
        raise typer.Exit(1) from error
    _print_report(report)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


def _in_process(
    corpus: Path,
    queries: Path,
    qrels: Path,
    data_dir: Path | None,
    window: int,
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
    with progress_bar(console) as bar:
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
    window: int,
    rerank: bool,
    max_queries: int | None,
) -> dict[str, Any]:
    """Each run as one batch through the gateway (the runs of the in-process evaluation, the
    same modes, depths and rerank choice), then scored from the hits the API returned."""
    qrels = read_qrels(qrels_path)
    queries = _judged(queries_path, qrels_path, qrels, max_queries)
    runs = eval_runs(rerank)
    rankings: dict[str, dict[str, list[str]]] = {}
    usage: dict[str, float | None] = {}
    failed = 0
    submitted, served = _run_batches(index, runs, queries, out)
    for run in runs:
        rankings[run.name] = {}
        for item in served[run.name]:
            result = item.get("result") if item.get("status") == "succeeded" else None
            failed += result is None
            hits = (result or {}).get("hits") or []
            rankings[run.name][str(item["query_id"])] = [str(hit["id"]) for hit in hits]
            add_usage(usage, (result or {}).get("usage") or {})
    report = score_runs(rankings, runs, qrels, queries, window)
    report["failed"] = failed
    report["usage"] = usage
    report["batches"] = submitted
    return report


def _run_batches(
    index: str, runs: list[RunSpec], queries: list[tuple[str, str]], out: Path | None
) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """Each run as one batch through the gateway, all submitted at once: the batch ids and
    every result of each, in submission order (kept under ``out`` when given)."""
    with gateway() as client, _cancel_runs_on_interrupt(client, len(runs)) as submitted:
        for run in runs:
            submitted[run.name] = _submit(client, index, run, queries)
        with progress_bar(console) as bar:
            tasks = {
                name: bar.add_task(f"{name} via {index}", total=len(queries)) for name in submitted
            }
            pending = dict(submitted)
            while pending:
                for name, batch_id in list(pending.items()):
                    # a GET: read again through a transient failure, as `sift batch` waits
                    path = f"/v1/batches/{batch_id}"
                    counts = client.json("GET", path, retry_for=RETRY_SECONDS).get("counts") or {}
                    finished = sum(int(counts.get(s, 0)) for s in FINAL_STATUSES)
                    bar.update(tasks[name], completed=finished)
                    if finished >= len(queries):
                        del pending[name]
                if pending:
                    time.sleep(0.5)
        served = {}
        for run in runs:
            served[run.name] = list(_results(client, submitted[run.name]))
            if out is not None:
                _write_jsonl(out / f"{run.name.split()[0]}.jsonl", served[run.name])
    return submitted, served


@contextmanager
def _cancel_runs_on_interrupt(client: Gateway, runs: int) -> Iterator[dict[str, str]]:
    """Yields the runs' batch ids as they are made; Ctrl-C meanwhile cancels every one, says
    what each cancel did and exits 130, as ``sift batch`` does (Ctrl-C again leaves at once,
    naming the batches whose cancel may not have been made): the scores are this command's
    to make, so batches left running would spend their searches (and a reranked run its
    model calls) for nothing."""
    submitted: dict[str, str] = {}
    try:
        yield submitted
    except KeyboardInterrupt:
        err = cli_console(stderr=True)
        for done, (name, batch_id) in enumerate(submitted.items()):
            try:
                said = _cancel_outcome(batch_id, client.json("DELETE", f"/v1/batches/{batch_id}"))
            except KeyboardInterrupt:  # Ctrl-C again: leave now, naming what may run on
                left = ", ".join(list(submitted.values())[done:])
                err.print(
                    f"interrupted again: the cancels of {left} may not have been made; they "
                    "may still be running (DELETE /v1/batches/{id} cancels each)",
                    soft_wrap=True,
                    markup=False,
                )
                raise typer.Exit(EXIT_INTERRUPTED) from None
            except GatewayError as exc:
                said = (
                    f"batch {batch_id} had already finished: nothing canceled"
                    if exc.status_code == 409
                    else f"{plain(exc)}; batch {batch_id} may still be running"
                )
            err.print(f"interrupted: the {name} run's {said}", soft_wrap=True)
        if len(submitted) < runs:
            err.print(
                "interrupted while submitting: a run's batch may have been accepted and run on; "
                "`sift batches --limit 1` shows it",
                soft_wrap=True,
            )
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _submit(client: Gateway, index: str, run: RunSpec, queries: list[tuple[str, str]]) -> str:
    items = [
        {"id": qid, "query": text, "mode": run.mode, "limit": run.limit} for qid, text in queries
    ]
    body = {"index": index, "queries": items, "rerank": run.rerank}
    return str(client.json("POST", "/v1/batches", json=body)["id"])


def _results(client: Gateway, batch_id: str) -> Iterator[dict[str, Any]]:
    """Every result of a batch, page by page, in submission order."""
    for page in client.pages(f"/v1/batches/{batch_id}/results", {"page_size": PAGE_SIZE}):
        yield from page.get("results") or []


def _write_jsonl(path: Path, items: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    temp.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    os.replace(temp, path)


def _scored_file(results: Path, qrels: Path, window: int) -> dict[str, Any]:
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
    for name, values in report["runs"].items():
        ranked = depth.get(name)
        table.add_row(
            name, *(f"{values[m]:.3f}" for m in measures), "" if ranked is None else str(ranked)
        )
    console.print(table)
    recall = report["candidate_recall"]
    console.print(
        f"candidate recall@{recall['window']} (end-to-end): {recall['end_to_end']:.3f}; "
        f"queries with a relevant candidate in the window: "
        f"{recall['queries_with_a_relevant_candidate']}/{report['queries']}"
    )
    by_ranking = recall.get("by_ranking") or {}
    if len(by_ranking) > 1:
        console.print(
            f"candidate recall@{recall['window']} by ranking: "
            + ", ".join(f"{name} {value:.3f}" for name, value in by_ranking.items())
        )
    for name, versus in (report.get("fusion_vs_channels") or {}).items():
        console.print(
            f"{name} per query (nDCG@10) vs the better channel on that query: "
            f"{_shares(versus['vs_better_channel_per_query'])}; vs {versus['best_channel']} "
            f"(better on average): {_shares(versus['vs_best_channel'])}"
        )
        if versus["hurts"]:
            console.print(
                f"[yellow]fusion hurts here: {name} {versus['ndcg@10']:.3f} < "
                f"{versus['best_channel']} alone {versus['best_channel_ndcg@10']:.3f}[/]; "
                "`sift eval --tune` chooses weights on your judgments"
            )
    held = recall.get("candidates_held", recall["window"])
    if held < recall["window"]:
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
        console.print(f"[red]{report['failed']} search(es) did not succeed[/]; they score 0")
    usage = report.get("usage") or {}
    if usage.get("requests"):
        console.print(
            f"rerank usage: {int(usage['requests'])} requests, "
            f"{int(usage['input_tokens'])} input / {int(usage['output_tokens'])} output tokens, "
            f"{format_cost(usage.get('cost_usd', 0.0))}"
        )


def _tune_command(
    index: str,
    queries_path: Path,
    qrels_path: Path,
    out: Path | None,
    folds: int,
    seed: int,
    apply: bool,
    max_queries: int | None,
    json_out: Path | None,
) -> None:
    """``--tune``: tune on the served index's rankings, print the folds, and with ``--apply``
    store the chosen settings unless the held-out figure is below a channel alone."""
    try:
        report = _tune_served(index, queries_path, qrels_path, out, folds, seed, max_queries)
    except (GatewayError, ValueError) as error:
        console.print(f"[red]error:[/red] {plain(error)}", soft_wrap=True)
        raise typer.Exit(1) from error
    _print_tune(report)
    data: dict[str, Any] = {"index": index, "folds_seed": seed, **report.as_dict()}
    refusal = report.refusal()
    data["applied"] = False
    try:
        if apply and refusal is None:
            with gateway() as client:
                stored = client.update_index(index, report.chosen.settings())
            data["applied"] = True
            console.print(f"applied to {index}: {json.dumps(stored.get('settings'))}")
    finally:
        if json_out:
            json_out.write_text(json.dumps(data, indent=2) + "\n")
    if apply and refusal is not None:
        console.print(f"[red]refused:[/red] {refusal}", soft_wrap=True)
        raise typer.Exit(EXIT_REFUSED)


def _tune_served(
    index: str,
    queries_path: Path,
    qrels_path: Path,
    out: Path | None,
    folds: int,
    seed: int,
    max_queries: int | None,
) -> TuneReport:
    """Fetch each judged query's BM25 and kNN rankings once (two batches, as deep as the API
    serves), then tune in-process: no further search, no model."""
    qrels = read_qrels(qrels_path)
    queries = _judged(queries_path, qrels_path, qrels, max_queries)
    split_folds([qid for qid, _ in queries], folds, seed)  # a bad --folds fails before searching
    runs = [RunSpec("bm25", "fts", False, MAX_LIMIT), RunSpec("knn", "vector", False, MAX_LIMIT)]
    _, served = _run_batches(index, runs, queries, out)
    failed = [i for items in served.values() for i in items if i.get("status") != "succeeded"]
    if failed:
        raise ValueError(
            f"{len(failed)} search(es) did not succeed (first: "
            f"{(failed[0].get('error') or {}).get('message')}); "
            "tuning needs every query's rankings"
        )
    rankings: dict[Channel, dict[str, list[Ranked]]] = {
        channel: {
            str(item["query_id"]): [_ranked(hit, channel) for hit in item["result"]["hits"]]
            for item in served[channel]
        }
        for channel in CHANNELS
    }
    scored = all(
        not isinstance(ranked, str)
        for per in rankings.values()
        for r in per.values()
        for ranked in r
    )
    grid = Grid() if scored else Grid(methods=("rrf",))
    if not scored:
        console.print("[yellow]the served hits carry no channel scores: linear fusion not tuned[/]")
    with progress_bar(console) as bar:
        task = bar.add_task("tuning: grid points scored", total=len(grid.points()))
        return tune(
            rankings,
            {qid: qrels[qid] for qid, _ in queries},
            grid,
            folds,
            seed,
            progress=lambda n: bar.advance(task, n),
        )


def _ranked(hit: dict[str, Any], channel: Channel) -> Ranked:
    """A served hit as the tuner ranks it: its id and its channel's score (``linear``
    fusion reads the score; a hit without one is ranked by its place alone)."""
    score = (hit.get("scores") or {}).get(channel)
    return str(hit["id"]) if score is None else (str(hit["id"]), float(score))


def _shares(shares: dict[str, float]) -> str:
    return f"lost {shares['lost']:.1%}, won {shares['won']:.1%}, tied {shares['tied']:.1%}"


def _print_tune(report: TuneReport) -> None:
    table = Table(
        title="held-out nDCG@10 per fold, of the point chosen on the other folds "
        f"(n: queries; RRF: the default fusion; recall: candidate recall at the tuned "
        f"window, and the default's at {DEFAULT.window}; chosen: method, weights bm25/knn, "
        "RRF's rank constant k, window w)",
        box=box.SIMPLE_HEAD,  # with one space between columns it fits 80, nothing cut
        padding=(0, 1, 0, 0),
        pad_edge=False,
    )
    columns = ["fold", "n", "tuned", "RRF", "bm25", "knn", "recall", "RRF recall", "chosen"]
    for column in columns:
        table.add_column(column, justify="left" if column == "chosen" else "right", overflow="fold")
    for n, fold in enumerate(report.folds, start=1):
        ndcgs = (fold.tuned, fold.default, fold.bm25, fold.knn)
        table.add_row(
            str(n),
            str(fold.queries),
            *(f"{m.ndcg:.4f}" for m in ndcgs),
            f"{fold.tuned.recall:.3f}",
            f"{fold.default.recall:.3f}",
            _describe(fold.chosen, short=True),
        )
    held = report.held_out
    table.add_row(
        "all", str(sum(f.queries for f in report.folds)),
        *(f"[bold]{held[n].ndcg:.4f}[/]" for n in ("tuned", "default", "bm25", "knn")),
        f"{held['tuned'].recall:.3f}", f"{held['default'].recall:.3f}", "",
    )  # fmt: skip
    console.print(table)
    console.print(
        f"chosen on all {sum(f.queries for f in report.folds)} queries: "
        f"[bold]{_describe(report.chosen)}[/] (nDCG@10 {report.in_sample.ndcg:.4f} on the "
        "queries it was chosen on: optimistic; the held-out row is the estimate)"
    )
    below = report.folds_below_best_single()
    if below:
        console.print(
            f"[yellow]fold(s) {', '.join(map(str, below))}: the tuned fusion scored below "
            "the better channel alone there[/]"
        )
    channel, best = report.best_single
    console.print(
        f"held out: tuned {held['tuned'].ndcg:.4f} vs {channel} alone {best:.4f}, "
        f"default RRF {held['default'].ndcg:.4f}; {report.points} points searched, "
        f"channels fetched {max(report.depth.values())} deep (a window past "
        f"{max(report.depth.values()) // 4} fuses them there, where the worker would fuse "
        "4 x window)"
    )
    chosen = report.chosen
    if chosen.method == "linear" and chosen.window > max(report.depth.values()) // 4:
        console.print(
            f"[yellow]linear fusion at window {chosen.window}: the worker normalises each "
            f"channel over its {4 * chosen.window} hits, here over the "
            f"{max(report.depth.values())} fetched, so served figures can differ a little "
            "(docs/evaluation.md: Tuning the fusion)[/]"
        )


def _describe(point: Point, short: bool = False) -> str:
    linear = point.method == "linear"
    if short:  # method, weights bm25/knn, rank constant (RRF), window
        if linear:
            return f"linear {point.bm25:g}/{point.knn:g} w{point.window}"
        return f"rrf {point.bm25:g}/{point.knn:g} k{point.rank_constant} w{point.window}"
    weights = f"bm25 {point.bm25:g}, knn {point.knn:g}"
    if point.single:
        return f"{point.single} alone (weights {weights}), window {point.window}"
    if linear:
        return f"linear fusion, weights {weights}, window {point.window}"
    return f"RRF, weights {weights}, k {point.rank_constant}, window {point.window}"
