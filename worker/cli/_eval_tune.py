"""``sift eval --index --tune``: fetch the served index's BM25 and kNN rankings once, tune the
fusion on the qrels by k-fold cross-validation, print the folds, and with ``--apply`` store
the chosen settings on the index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from worker.cli._common import _err
from worker.cli._eval_runs import _check_index, _index_written, _judged, _run_batches, console
from worker.cli._http import GatewayError, gateway
from worker.cli._output import plain, progress_bar
from worker.constants import MAX_LIMIT
from worker.contract import Channel
from worker.errors import ConfigError
from worker.evaluation.inputs import read_qrels
from worker.evaluation.scoring import RunSpec
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
from worker.settings import load_settings

EXIT_REFUSED = 3  # --apply refused: the tuned fusion is below a channel alone or the index's own


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
    store the chosen settings unless the held-out figure is below a channel alone or the
    index's current settings."""
    try:
        report = _tune_served(index, queries_path, qrels_path, out, folds, seed, max_queries)
    except (GatewayError, ValueError, ConfigError) as error:
        _err().print(f"[red]error:[/red] {plain(error)}", soft_wrap=True)
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
        _err().print(f"[red]refused:[/red] {refusal}", soft_wrap=True)  # stdout: the folds
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
    # what the index leaves unset is the deployment's, SIFT_FUSION_* as a worker reads them
    default = Point.of_deployment(load_settings())
    before = _check_index(index)
    current = Point.of_settings(before.get("settings"), default)
    runs = [RunSpec("bm25", "fts", False, MAX_LIMIT), RunSpec("knn", "vector", False, MAX_LIMIT)]
    _, served = _run_batches(index, runs, queries, out)
    if written := _index_written(index, before):  # its two rankings may be of two states
        raise ValueError(
            f"index {index!r} was written while its rankings were read ({written}): tuning "
            "needs one state of it; tune again while nothing writes it"
        )
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
    if not scored:  # a warning, on stderr: stdout is the report
        _err().print("[yellow]the served hits carry no channel scores: linear fusion not tuned[/]")
    with progress_bar() as bar:
        task = bar.add_task("tuning: grid points scored", total=len(grid.points()))
        return tune(
            rankings,
            {qid: qrels[qid] for qid, _ in queries},
            grid,
            folds,
            seed,
            progress=lambda n: bar.advance(task, n),
            current=current,
            default=default,
        )


def _ranked(hit: dict[str, Any], channel: Channel) -> Ranked:
    """A served hit as the tuner ranks it: its id and its channel's score (``linear``
    fusion reads the score; a hit without one is ranked by its place alone)."""
    score = (hit.get("scores") or {}).get(channel)
    return str(hit["id"]) if score is None else (str(hit["id"]), float(score))


def _print_tune(report: TuneReport) -> None:
    deployment = (
        "" if report.default == DEFAULT else f", the deployment's: {_describe(report.default)}"
    )
    table = Table(
        title="held-out nDCG@10 per fold, of the point chosen on the other folds "
        f"(n: queries; RRF: the default fusion{deployment}; recall: candidate recall at the "
        f"tuned window, and the default's at {report.default.window}; chosen: method, weights "
        "bm25/knn, RRF's rank constant k, window w)",
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
    current = (
        ""
        if report.current == report.default or "current" not in held
        else f", the index's current settings ({_describe(report.current)}) "
        f"{held['current'].ndcg:.4f}"
    )
    console.print(
        f"held out: tuned {held['tuned'].ndcg:.4f} vs {channel} alone {best:.4f}, "
        f"default {report.default.method_name} {held['default'].ndcg:.4f}{current}; "
        f"{report.points} points searched, "
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
