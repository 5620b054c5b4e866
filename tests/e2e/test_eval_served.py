"""``sift eval --index`` and ``--results`` over the real stack: the CLI as a process, the
sample corpus ingested through the API, a small qrels file of our own.

Every figure the CLI reports is checked against ir-measures run here on the very results
the API served (the ``--out`` files, or the ``sift batch`` output), and the runs are checked
to be what the API serves to anyone (a search of our own returns the same ranking).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ir_measures
import pytest
from ir_measures import RR, R, nDCG
from typer.testing import CliRunner

from api_gateway.schemas import SearchRequest
from tests.e2e.conftest import ACME, ANTHROPIC_API_KEY, INDEX, MODEL, SAMPLE, Stack
from tests.e2e.test_batch_cli_gateway_restart import SCALED_SECONDS, _DeadClaimHandler, _Proxy
from tests.fake_anthropic import USAGE_FIELDS, positions, refusal
from tests.services import served as serving
from worker.cli import app
from worker.processes.stack import child_env, sift_command
from worker.queue.jobstore import fingerprint

QRELS = Path(__file__).parent / "data" / "sample_qrels.tsv"
QUERIES = SAMPLE / "sample_queries.jsonl"
MEASURES = [nDCG @ 10, RR @ 10, R @ 10, R @ 100]
JUDGED = 9  # q10 has no qrels; q9's second pair is judged 0


def _qrels() -> list[ir_measures.Qrel]:
    rows = [line.split("\t") for line in QRELS.read_text().splitlines()[1:]]
    return [ir_measures.Qrel(q, d, int(r)) for q, d, r in rows if int(r) >= 1]


def _expected(rankings: dict[str, list[str]]) -> dict[str, float]:
    """ir-measures over ``rankings`` (query id -> ids, best first), on the judged queries."""
    run = [
        ir_measures.ScoredDoc(qid, doc, float(len(docs) - i))
        for qid, docs in rankings.items()
        for i, doc in enumerate(docs)
    ]
    qrels = [q for q in _qrels() if q.query_id in rankings]
    values = ir_measures.calc_aggregate(MEASURES, qrels, run)
    return {str(m): float(values[m]) for m in MEASURES}


def _hits_order(path: Path) -> dict[str, list[str]]:
    judged = {q.query_id for q in _qrels()}
    items = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(item["status"] == "succeeded" for item in items), items
    return {
        item["query_id"]: [hit["id"] for hit in item["result"]["hits"]]
        for item in items
        if item["query_id"] in judged
    }


def _sift(stack: Stack, *args: str) -> str:
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001"})
    done = subprocess.run(
        sift_command(*args), env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr  # as a terminal shows them: the bars are on stderr


@pytest.fixture(scope="module")
def served(stack: Stack, corpus: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sift eval --index`` once; its folder holds ``report.json`` and each run's results."""
    folder = tmp_path_factory.mktemp("eval-index")
    printed = _sift(
        stack, "eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS),
        "--out", str(folder / "runs"), "--json", str(folder / "report.json"),
    )  # fmt: skip
    (folder / "printed.txt").write_text(printed)
    return folder


def test_eval_index_reports_what_ir_measures_gives_on_the_served_results(served: Path) -> None:
    report = json.loads((served / "report.json").read_text())
    assert report["queries"] == JUDGED and report["failed"] == 0
    for run in ("bm25", "knn", "fused"):
        expected = _expected(_hits_order(served / "runs" / f"{run}.jsonl"))
        assert report["runs"][run] == pytest.approx(expected, abs=1e-12), run
    assert report["runs"]["fused"]["nDCG@10"] > 0.5  # the sample queries are easy
    # candidate recall at the window: the window run's 30 (what a reranked search fuses)
    fused = _hits_order(served / "runs" / "window.jsonl")
    relevant: dict[str, set[str]] = {}
    for qrel in _qrels():
        relevant.setdefault(qrel.query_id, set()).add(qrel.doc_id)
    recalls = [len(set(fused[q][:30]) & docs) / len(docs) for q, docs in relevant.items()]
    recall = report["candidate_recall"]
    assert recall["end_to_end"] == pytest.approx(sum(recalls) / len(recalls))
    assert recall["queries_with_a_relevant_candidate"] == sum(r > 0 for r in recalls)
    printed = (served / "printed.txt").read_text()
    for row in ("bm25", "knn", "fused", "final, conditional on the window"):
        assert row in printed
    assert f"{report['runs']['fused']['nDCG@10']:.3f}" in printed
    assert "MRR@10" in printed and f"{report['runs']['fused']['RR@10']:.3f}" in printed
    assert f"candidate recall@30 (end-to-end): {recall['end_to_end']:.3f}" in printed
    assert "/?" not in printed  # every progress bar had its total


def test_eval_index_runs_are_batches_the_api_served(stack: Stack, served: Path) -> None:
    report = json.loads((served / "report.json").read_text())
    assert set(report["batches"]) == {"bm25", "knn", "fused", "window"}
    for batch_id in report["batches"].values():
        batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
        assert batch["status"] == "succeeded" and batch["counts"]["succeeded"] == JUDGED
    # what anyone searching the index the same way gets
    fused = _hits_order(served / "runs" / "fused.jsonl")
    body = {"index": INDEX, "query": "who beat Kasparov", "limit": 100, "rerank": False}
    job = stack.live.post("/v1/searches", params={"wait": 30}, json=body, headers=ACME).json()
    assert [hit["id"] for hit in job["result"]["hits"]] == fused["q4"]


def test_eval_results_scores_a_batch_file(stack: Stack, served: Path, tmp_path: Path) -> None:
    """A hybrid batch of depth 100 over 30 documents holds every document either channel
    found, so the channel runs it implies are the channel runs themselves: the BM25 and kNN
    rows equal those of the separate fts and vector batches of ``--index``."""
    results = tmp_path / "results.jsonl"
    _sift(stack, "batch", str(QUERIES), "--index", INDEX, "--out", str(results),
          "--limit", "100", "--no-rerank")  # fmt: skip
    printed = _sift(stack, "eval", "--results", str(results), "--qrels", str(QRELS),
                    "--json", str(tmp_path / "report.json"))  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    index_report = json.loads((served / "report.json").read_text())
    assert report["queries"] == JUDGED
    assert report["runs"]["fused"] == pytest.approx(_expected(_hits_order(results)), abs=1e-12)
    for run in ("bm25", "knn", "fused"):
        assert report["runs"][run] == pytest.approx(index_report["runs"][run], abs=1e-12), run
        assert report["depth"][run] == index_report["depth"][run], run
    # 30 documents: the 30 the window fuses are the whole index, as the batch's 100 are
    recall, index_recall = report["candidate_recall"], index_report["candidate_recall"]
    assert recall["approximated"] is not None and index_recall["approximated"] is None
    assert recall | {"approximated": None} == index_recall
    assert "final (reranked)" not in report["runs"]
    assert f"{report['runs']['bm25']['nDCG@10']:.3f}" in printed


def test_eval_results_scores_the_reranked_order(stack: Stack, corpus: object,
                                               tmp_path: Path) -> None:  # fmt: skip
    """Reranked results: the final row is the hits as served; the fused row is unknown
    (``None``, ``–`` in the table): the hits hold the fused ranks of those the model kept
    only. It was the part of the fused ranking the hits held without a gap, often none of
    it, scored 0.000."""
    results = tmp_path / "reranked.jsonl"
    _sift(stack, "batch", str(QUERIES), "--index", INDEX, "--out", str(results),
          "--limit", "5", "--rerank")  # fmt: skip
    printed = _sift(stack, "eval", "--results", str(results), "--qrels", str(QRELS),
                    "--json", str(tmp_path / "report.json"))  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    items = [json.loads(line) for line in results.read_text().splitlines()]
    assert all(item["result"]["rerank"]["applied"] for item in items)
    final = _hits_order(results)
    assert report["runs"]["final (reranked)"] == pytest.approx(_expected(final), abs=1e-12)
    assert report["depth"]["final (reranked)"] == 5
    assert set(report["runs"]["fused"].values()) == {None}
    assert report["candidate_recall"]["end_to_end"] is None
    assert "–: unknown" in printed
    assert report["usage"]["requests"] >= JUDGED  # the usage of the served searches


def test_eval_index_with_rerank_adds_the_served_final_run(stack: Stack, corpus: object,
                                                          tmp_path: Path) -> None:  # fmt: skip
    printed = _sift(
        stack, "eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS),
        "--rerank", "--out", str(tmp_path), "--json", str(tmp_path / "report.json"),
    )  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["batches"]) == {"bm25", "knn", "fused", "window", "final (reranked)"}
    final = _hits_order(tmp_path / "final.jsonl")
    items = [json.loads(line) for line in (tmp_path / "final.jsonl").read_text().splitlines()]
    assert all(item["result"]["rerank"]["applied"] for item in items)
    assert report["runs"]["final (reranked)"] == pytest.approx(_expected(final), abs=1e-12)
    assert report["depth"]["final (reranked)"] == 10
    assert report["usage"]["requests"] >= JUDGED
    assert "rerank usage:" in printed and "final (reranked)" in printed


def test_eval_names_the_reranked_searches_served_the_fused_order(
    stack: Stack, corpus: object, tmp_path: Path
) -> None:
    """The model's first answer holds no valid position (99 of the candidates): that search
    is served the fused order (``rerank.applied`` false, ``no_valid_ranks``), and the final
    (reranked) row scores it so. ``--index`` and ``--results`` of its file say how many and
    why (``rerank_fallbacks`` in ``--json``); they scored it as the model's, saying nothing."""
    stack.model.reset()
    stack.model.script([positions([99])])
    printed = _sift(
        stack, "eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS),
        "--rerank", "--out", str(tmp_path), "--json", str(tmp_path / "report.json"),
    )  # fmt: skip
    final = tmp_path / "final.jsonl"
    items = [json.loads(line)["result"]["rerank"] for line in final.read_text().splitlines()]
    assert [r["fallback_reason"] for r in items if not r["applied"]] == ["no_valid_ranks"]
    said = "1 reranked search(es) fell back to the fused order (no_valid_ranks 1)"
    assert said in " ".join(printed.split()), printed
    assert json.loads((tmp_path / "report.json").read_text())["rerank_fallbacks"] == {
        "no_valid_ranks": 1
    }
    printed = _sift(stack, "eval", "--results", str(final), "--qrels", str(QRELS),
                    "--json", str(tmp_path / "results.json"))  # fmt: skip
    assert said in " ".join(printed.split()), printed
    assert json.loads((tmp_path / "results.json").read_text())["rerank_fallbacks"] == {
        "no_valid_ranks": 1
    }


def test_eval_index_compares_a_run_with_the_channels_only_on_the_queries_it_answered(
    stack: Stack, corpus: object, tmp_path: Path
) -> None:
    """The reranked run's model refuses all but three of its searches (each fails
    ``rerank_failed``): the run is compared with the channels on the three queries it
    answered, as ir-measures scores them from the served results, and says so; the fused
    run, on all. Its failed searches' 0s were compared as rankings: "lost" on every query
    where a channel found something."""
    stack.model.reset()
    stack.model.script([refusal()] * (JUDGED - 3))
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001",
                     "COLUMNS": "400"})  # fmt: skip
    done = subprocess.run(
        sift_command("eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS),
                     "--rerank", "--out", str(tmp_path), "--json", str(tmp_path / "report.json")),
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed_by_run"]["final (reranked)"] == JUDGED - 3, report["failed_by_run"]
    items = [json.loads(line) for line in (tmp_path / "final.jsonl").read_text().splitlines()]
    answered = {i["query_id"] for i in items if i["status"] == "succeeded"} & _judged()
    assert len(answered) == 3, items
    ndcg = {run: _ndcg_per_query(tmp_path / f"{run}.jsonl", answered)
            for run in ("final", "bm25", "knn")}  # fmt: skip
    diffs = [ndcg["final"][q] - max(ndcg["bm25"][q], ndcg["knn"][q]) for q in answered]
    versus = report["fusion_vs_channels"]
    assert versus["final (reranked)"]["vs_better_channel_per_query"] == pytest.approx({
        "lost": sum(d < -1e-9 for d in diffs) / 3, "won": sum(d > 1e-9 for d in diffs) / 3,
        "tied": sum(abs(d) <= 1e-9 for d in diffs) / 3}), (versus, ndcg)  # fmt: skip
    mean = {run: sum(values.values()) / 3 for run, values in ndcg.items()}
    final = versus["final (reranked)"]
    assert final["ndcg@10"] == pytest.approx(mean["final"]), (versus, mean)
    assert final["best_channel_ndcg@10"] == pytest.approx(max(mean["bm25"], mean["knn"])), versus
    assert final["queries"] == 3 and versus["fused"]["queries"] == JUDGED
    shown = " ".join(done.stdout.split())
    assert f"(on the 3 of {JUDGED} queries it and both channels answered)" in shown, shown


def _judged() -> set[str]:
    return {q.query_id for q in _qrels()}


def _ndcg_per_query(path: Path, queries: set[str]) -> dict[str, float]:
    """ir-measures' nDCG@10 of each of ``queries`` in a run's results (0: none relevant)."""
    items = [json.loads(line) for line in path.read_text().splitlines()]
    run = [ir_measures.ScoredDoc(item["query_id"], hit["id"], -float(rank))
           for item in items if item["query_id"] in queries
           for rank, hit in enumerate(item["result"]["hits"])]  # fmt: skip
    qrels = [q for q in _qrels() if q.query_id in queries]
    found = {m.query_id: m.value for m in ir_measures.iter_calc([nDCG @ 10], qrels, run)}
    return {q: float(found.get(q, 0.0)) for q in queries}


def test_eval_index_gives_the_in_process_figures(
    stack: Stack, served: Path, tmp_path: Path
) -> None:
    """The served index and an in-process index of the same corpus score the same (the
    acceptance's 0.002 on nDCG@10; on SciFact the two agreed to the last digit)."""
    _sift(
        stack, "eval", "--corpus", str(SAMPLE / "sample_corpus.jsonl"), "--queries", str(QUERIES),
        "--qrels", str(QRELS), "--data-dir", str(tmp_path / "index"),
        "--json", str(tmp_path / "report.json"),
    )  # fmt: skip
    in_process = json.loads((tmp_path / "report.json").read_text())
    report = json.loads((served / "report.json").read_text())
    assert set(in_process["runs"]) == set(report["runs"])
    for run, values in in_process["runs"].items():
        assert report["runs"][run]["nDCG@10"] == pytest.approx(values["nDCG@10"], abs=0.002), run


def test_eval_results_of_a_file_cut_short_names_the_judged_queries_it_lacks(
    stack: Stack, served: Path, tmp_path: Path
) -> None:
    """The first 3 lines of a run's results: scored as 3 queries, and said to lack the other
    judged ones (it was scored with no word of them)."""
    cut = tmp_path / "cut.jsonl"
    lines = (served / "runs" / "fused.jsonl").read_text().splitlines(keepends=True)
    judged = {q.query_id for q in _qrels()}
    kept = [line for line in lines if json.loads(line)["query_id"] in judged][:3]
    cut.write_text("".join(kept))
    printed = _sift(stack, "eval", "--results", str(cut), "--qrels", str(QRELS))
    shown = " ".join(printed.split())
    assert "3 queries" in shown, shown
    assert f"{JUDGED - 3} judged quer(y/ies) of the qrels have no line in the results" in shown


def test_eval_index_of_an_index_that_does_not_exist_stops_before_any_search(
    stack: Stack, tmp_path: Path
) -> None:
    """As every other index command: one line naming the index, exit 1. It ran the probe
    search, fell back to the default window, ran every run's searches and printed a table
    of 0.000 ending in `index_not_found`, exit 3 (the exit of failed searches); `--tune`
    ran its two batches before it said so."""

    def jobs() -> tuple[list[str], list[str]]:
        searches = stack.live.get("/v1/searches", headers=ACME).json()["searches"]
        batches = stack.live.get("/v1/batches", headers=ACME).json()["batches"]
        return [s["id"] for s in searches], [b["id"] for b in batches]

    before = jobs()
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001"})
    for extra in ((), ("--window", "20"), ("--tune",)):
        done = subprocess.run(
            sift_command("eval", "--index", "no-such-index", "--queries", str(QUERIES),
                         "--qrels", str(QRELS), *extra),
            env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        said = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1, said
        assert "index 'no-such-index' does not exist" in said, said
        assert "nDCG@10" not in said
    assert jobs() == before  # no search, no batch


def _billed(stack: Stack, before: dict[str, int]) -> dict[str, int]:
    """What the fake model billed since ``before`` (its ``usage()`` then): answers and tokens."""
    now = stack.model.usage()
    return {key: now[key] - before[key] for key in (*USAGE_FIELDS, "responses")}


def test_eval_index_rerank_usage_counts_a_failed_searchs_billed_call(
    stack: Stack, corpus: object, tmp_path: Path
) -> None:
    """The reranked run's first model call is refused (billed, never retried: the search
    fails ``rerank_failed``): the report's usage is what the model billed, the batch's own
    usage. It was the succeeded searches' only: 8 requests where 9 were billed."""
    stack.model.reset()
    stack.model.script([refusal()])
    before = stack.model.usage()
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001"})
    done = subprocess.run(
        sift_command("eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS),
                     "--rerank", "--out", str(tmp_path), "--json", str(tmp_path / "report.json")),
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    billed = _billed(stack, before)
    assert done.returncode == 3, done.stdout + done.stderr  # one search did not succeed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors"] == {"rerank_failed": 1}
    batch_id = report["batches"]["final (reranked)"]
    batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert report["usage"] == batch["usage"] | {
        "cost_usd": pytest.approx(batch["usage"]["cost_usd"])
    }
    assert report["usage"]["requests"] == billed["responses"] == JUDGED
    assert {k: report["usage"][k] for k in USAGE_FIELDS} == {k: billed[k] for k in USAGE_FIELDS}
    shown = " ".join(done.stdout.split())
    assert f"rerank usage: {JUDGED} requests, {billed['input_tokens']} input" in shown, shown


def test_eval_corpus_rerank_stopped_by_a_failed_search_says_what_was_billed(
    stack: Stack, tmp_path: Path
) -> None:
    """In-process, the first failed search stops the evaluation (exit 2, its error): the
    usage line before it says what the model calls so far cost, the refused one included.
    Nothing was said of them."""
    stack.model.reset()
    stack.model.script([refusal()])
    before = stack.model.usage()
    env = child_env({
        "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
        "ANTHROPIC_BASE_URL": stack.model.url,
        "ANTHROPIC_API_KEY": ANTHROPIC_API_KEY,
    })  # fmt: skip
    done = subprocess.run(
        sift_command("eval", "--corpus", str(SAMPLE / "sample_corpus.jsonl"),
                     "--queries", str(QUERIES), "--qrels", str(QRELS), "--rerank",
                     "--data-dir", str(tmp_path / "index")),
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    billed = _billed(stack, before)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stdout + done.stderr
    assert billed["responses"] == 1  # the refusal: the first reranked search, not retried
    usage = f"rerank usage: 1 requests, {billed['input_tokens']} input / "
    assert usage in said, said
    assert said.index(usage) < said.index("error: rerank failed (refused)"), said


class _DeadProbeClaimHandler(_DeadClaimHandler):
    """The first ``POST /v1/searches`` (``sift eval --index``'s probe of the candidate
    window) is claimed, and then its gateway dies (:class:`_DeadClaimHandler`); every other
    request, the runs' batches among them, is forwarded."""

    def submits(self) -> bool:
        return self.path.split("?")[0] == "/v1/searches"

    def fingerprint(self, body: bytes) -> str:
        search = SearchRequest.model_validate_json(body).model_dump(mode="json")
        return fingerprint("POST /v1/searches", search)

    def do_POST(self) -> None:
        if self.submits():
            super().do_POST()
            return
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(self._forward(body))

    def do_GET(self) -> None:
        self._answer(self._forward(None))  # the runs' polls answered as the gateway does


def test_eval_index_outwaits_the_claim_of_a_probe_whose_gateway_died(
    stack: Stack, corpus: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe search of ``sift eval --index`` is a keyed submission like ``sift search``'s:
    a gateway that died between claiming its key and making the job leaves the key "in
    progress" for ``IDEMPOTENCY_PENDING_TTL_SECONDS`` from that claim, and the probe is sent
    again for the marker's life past the retry window (``submit_retry_seconds``), then makes
    its job and the runs go on."""
    monkeypatch.setattr("worker.cli._http.RETRY_SECONDS", SCALED_SECONDS)
    monkeypatch.setattr("worker.cli._http.IDEMPOTENCY_PENDING_TTL_SECONDS", SCALED_SECONDS)
    server = _Proxy(stack.live_url)
    server.RequestHandlerClass = _DeadProbeClaimHandler
    server.redis_url = stack.redis_url + "/0"  # type: ignore[attr-defined]
    report = tmp_path / "report.json"
    with serving(server):
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env = {"SIFT_URL": url, "SIFT_API_KEY": ACME["Authorization"].split()[1],
               "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
        args = ["eval", "--index", INDEX, "--queries", str(QUERIES), "--qrels", str(QRELS)]
        result = CliRunner().invoke(app, [*args, "--json", str(report)], env=env)
    said = " ".join(result.output.split())
    assert result.exit_code == 0, said
    assert "has not created its job yet; retry after 1 s; trying again" in said, said
    assert len(set(server.batch_posts)) == 1 and len(server.batch_posts) > 2, server.batch_posts
    assert json.loads(report.read_text())["queries"] == JUDGED
