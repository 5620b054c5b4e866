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

import json
from pathlib import Path
from typing import Annotated

import typer

from worker.cli._app import app
from worker.cli._common import EXIT_ITEMS_FAILED, _err, a_folder, why_unwritable
from worker.cli._http import GatewayError, index_name
from worker.cli._output import plain
from worker.constants import MAX_CANDIDATE_LIMIT
from worker.errors import SiftError


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
        Path | None,
        typer.Option(
            parser=a_folder, help="--corpus: index directory; a cache per corpus by default"
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="--index: keep each run's results here, as `sift batch`")
    ] = None,
    window: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_CANDIDATE_LIMIT,
            help="rerank candidate window of candidate recall and of --rerank's run "
            "(default: the one the index's searches use)",
        ),
    ] = None,
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
    # here, not at the module's top: every other `sift` command imports this module too, and
    # these (ir-measures, numpy, the embedded backend, the in-process runtime) cost each one
    # about 0.2 CPU-s of its start (`sift search --help`: 0.70 CPU-s, 0.50 without)
    from worker.cli._eval_sources import (
        _in_process,
        _print_report,
        _print_usage,
        _scored_file,
        _served,
        _usage_error,
    )
    from worker.cli._eval_tune import _tune_command
    from worker.evaluation.harness import EvaluationStopped

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
    # before any search: an output it cannot write was a traceback after the whole run (the
    # runs' searches and model calls made and billed, the report on stdout only)
    for option, path, why in (
        ("--json", json_out, json_out and why_unwritable(json_out, in_place=True)),
        ("--out", out, out and why_unwritable(out / "bm25.jsonl", make_folders=True)),
    ):
        if why:
            raise _usage_error(f"{option}: cannot write {path} ({why}); nothing was run")
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
    except EvaluationStopped as error:  # the calls billed before it are paid all the same
        _print_usage(error.usage, _err())
        _err().print(f"[red]error:[/red] {plain(error)}", soft_wrap=True)
        raise typer.Exit(2) from error
    except SiftError as error:  # errors on stderr, as every command's: stdout is the report
        _err().print(f"[red]error:[/red] {plain(error)}", soft_wrap=True)
        raise typer.Exit(2) from error
    except (GatewayError, ValueError) as error:
        _err().print(f"[red]error:[/red] {plain(error)}", soft_wrap=True)
        raise typer.Exit(1) from error
    _print_report(report)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
    # failed searches' zeros are in every figure, and the runs of an index written meanwhile
    # may each have read another state of it: no quality gate may pass on either
    if report.get("failed") or report.get("index_written"):
        raise typer.Exit(EXIT_ITEMS_FAILED)
