"""``sift eval --tune`` over the real stack: the CLI as a process, the sample corpus ingested
through the API, the small qrels file of ``test_eval_served.py``.

The channel rankings the tuning fetched (its ``--out`` files) are the ones the API serves,
and the default point it scores in-process is what a served hybrid search returns; so is a
linear-fusion point, fused in-process from the channel scores those files carry.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import ir_measures
import pytest
from ir_measures import nDCG

from tests.e2e.conftest import ACME, INDEX, SAMPLE, Stack
from worker.evaluation.tuning import Point, fuse
from worker.processes.stack import child_env, sift_command

QRELS = Path(__file__).parent / "data" / "sample_qrels.tsv"
QUERIES = SAMPLE / "sample_queries.jsonl"
JUDGED = 9  # q10 has no qrels; q9's second pair is judged 0


def _qrels() -> list[ir_measures.Qrel]:
    rows = [line.split("\t") for line in QRELS.read_text().splitlines()[1:]]
    return [ir_measures.Qrel(q, d, int(r)) for q, d, r in rows if int(r) >= 1]


def _ndcg(path: Path) -> float:
    """Mean nDCG@10 of the hits of the judged queries in a results file."""
    judged = {q.query_id for q in _qrels()}
    items = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(item["status"] == "succeeded" for item in items), items
    run = [
        ir_measures.ScoredDoc(item["query_id"], hit["id"], -float(n))
        for item in items
        if item["query_id"] in judged
        for n, hit in enumerate(item["result"]["hits"][:10])
    ]
    return float(ir_measures.calc_aggregate([nDCG @ 10], _qrels(), run)[nDCG @ 10])


def _sift(stack: Stack, *args: str, expect: int = 0, env: dict[str, str] | None = None) -> str:
    env = child_env({"SIFT_URL": stack.live_url, "SIFT_API_KEY": "acme-key-0001", **(env or {})})
    done = subprocess.run(
        sift_command(*args), env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == expect, done.stdout + done.stderr
    return done.stdout + done.stderr  # as a terminal shows them: the bars are on stderr


def _runs(folder: Path) -> dict[str, dict[str, list[tuple[str, float]]]]:
    """The channel rankings a tuning fetched (its ``--out`` files): channel -> query id ->
    each hit's id and channel score."""
    return {
        channel: {
            item["query_id"]: [(h["id"], h["scores"][channel]) for h in item["result"]["hits"]]
            for item in map(json.loads, (folder / f"{channel}.jsonl").read_text().splitlines())
        }
        for channel in ("bm25", "knn")
    }


@pytest.fixture(scope="module")
def tuned(stack: Stack, corpus: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sift eval --tune`` once (3 folds of 3 queries); the folder holds ``report.json``,
    the fetched rankings (``runs/``) and what it printed."""
    folder = tmp_path_factory.mktemp("eval-tune")
    printed = _sift(
        stack, "eval", "--tune", "--index", INDEX, "--queries", str(QUERIES),
        "--qrels", str(QRELS), "--folds", "3", "--out", str(folder / "runs"),
        "--json", str(folder / "report.json"),
    )  # fmt: skip
    (folder / "printed.txt").write_text(printed)
    return folder


def test_tune_holds_every_query_out_once_and_reports_held_out_figures(tuned: Path) -> None:
    report = json.loads((tuned / "report.json").read_text())
    assert [fold["queries"] for fold in report["folds"]] == [3, 3, 3]
    held = report["held_out"]
    # the held-out row is every query scored once, by the point chosen without it
    mean = sum(fold["tuned"]["ndcg@10"] * fold["queries"] for fold in report["folds"]) / JUDGED
    assert held["tuned"]["ndcg@10"] == pytest.approx(mean)
    # a channel alone is not tuned: its row is what the API served for that channel
    assert held["bm25"]["ndcg@10"] == pytest.approx(_ndcg(tuned / "runs" / "bm25.jsonl"))
    assert held["knn"]["ndcg@10"] == pytest.approx(_ndcg(tuned / "runs" / "knn.jsonl"))
    assert report["applied"] is False and report["chosen"]["candidate_limit"] >= 1
    printed = (tuned / "printed.txt").read_text()
    assert f"{held['tuned']['ndcg@10']:.4f}" in printed and "chosen on all 9 queries" in printed
    assert "/?" not in printed  # every progress bar had its total


def test_the_default_point_is_what_a_served_hybrid_search_returns(
    stack: Stack, tuned: Path, tmp_path: Path
) -> None:
    """The in-process fusion at the default settings (window 30: channels cut at 120, the
    fused list at 30) equals a served hybrid batch at limit 30 without a model."""
    results = tmp_path / "hybrid.jsonl"
    _sift(stack, "batch", str(QUERIES), "--index", INDEX, "--out", str(results),
          "--limit", "30", "--no-rerank")  # fmt: skip
    report = json.loads((tuned / "report.json").read_text())
    assert report["held_out"]["default"]["ndcg@10"] == pytest.approx(_ndcg(results), abs=1e-12)


def test_a_linear_point_is_what_a_served_linear_hybrid_search_returns(
    stack: Stack, tuned: Path
) -> None:
    """The tuner's in-process linear fusion (from the fetched runs' channel scores, each
    channel cut at 40 and min-max normalised there) equals a served hybrid search of limit 10
    with the same ``fusion`` and no model, hit for hit."""
    point = Point.linear(0.3, 10)
    runs = _runs(tuned / "runs")
    fusion = {"method": "linear", "weights": {"bm25": point.bm25, "knn": point.knn}}
    compared = differs = 0
    for line in QUERIES.read_text().splitlines():
        query = json.loads(line)
        if query["id"] not in runs["bm25"]:
            continue  # a query without judgments is not fetched by the tuning
        body = {
            "index": INDEX, "query": query["query"], "limit": 10, "rerank": False,
            "fusion": fusion, "include_trace": True,
        }  # fmt: skip
        job = stack.live.post("/v1/searches", params={"wait": 30}, json=body, headers=ACME).json()
        assert job["status"] == "succeeded", job
        served = [hit["id"] for hit in job["result"]["hits"]]
        ranked = {channel: runs[channel].get(query["id"], []) for channel in runs}
        assert served == fuse(ranked, point), query
        differs += served != fuse(ranked, Point(window=10))  # RRF over the same lists
        assert job["result"]["trace"]["fusion"]["method"] == "linear"
        assert job["result"]["trace"]["fusion"]["from"]["method"] == "request"
        compared += bool(served)
    assert compared == JUDGED  # every judged query, each with hits
    assert differs > 0  # and linear fusion is not RRF under another name


def test_apply_stores_the_chosen_settings_on_the_index(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path
) -> None:
    """On an index of its own (the others keep the defaults): --apply stores what it chose,
    the index's metadata shows it, and a hybrid search then fuses with it."""
    index = "tuned"
    response = stack.live.post(
        f"/v1/indexes/{index}/documents", params={"wait": 20},
        json={"documents": corpus}, headers=ACME,
    )  # fmt: skip
    assert response.status_code == 200 and response.json()["status"] == "succeeded"
    report_path = tmp_path / "report.json"
    _sift(stack, "eval", "--tune", "--apply", "--index", index, "--queries", str(QUERIES),
          "--qrels", str(QRELS), "--folds", "3", "--json", str(report_path))  # fmt: skip
    report = json.loads(report_path.read_text())
    assert report["applied"] is True and report["refusal"] is None
    metadata = stack.live.get(f"/v1/indexes/{index}", headers=ACME).json()
    assert metadata["settings"]["fusion"] == report["chosen"]["fusion"]
    assert metadata["settings"]["candidate_limit"] == report["chosen"]["candidate_limit"]
    body = {"index": index, "query": "who beat Kasparov", "include_trace": True}
    job = stack.live.post("/v1/searches", params={"wait": 30}, json=body, headers=ACME).json()
    assert job["result"]["trace"]["fusion"]["weights"] == report["chosen"]["fusion"]["weights"]
    # tuned again, it scores the settings the index now has as its "current", the figure a
    # later --apply must beat (the defaults were that figure the first time)
    assert report["current"] == {
        "fusion": {"method": "rrf", "weights": {"bm25": 1.0, "knn": 1.0}, "rank_constant": 60},
        "candidate_limit": 30,
    }
    again = tmp_path / "again.json"
    _sift(stack, "eval", "--tune", "--index", index, "--queries", str(QUERIES),
          "--qrels", str(QRELS), "--folds", "3", "--json", str(again))  # fmt: skip
    assert json.loads(again.read_text())["current"] == report["chosen"]


def test_what_an_index_leaves_unset_is_the_deployments_fusion(
    stack: Stack, corpus: list[dict[str, object]], tmp_path: Path
) -> None:
    """With ``SIFT_FUSION_*`` and ``SIFT_RERANK_CANDIDATE_LIMIT`` set, an index with no
    settings of its own is fused at theirs, so the tuning's baseline (``default``) and the
    index's ``current`` are that point, scored as that point fuses the fetched rankings. They
    were this code's defaults (RRF 1/1, k 60, window 30) whatever the deployment set, and an
    ``--apply`` was judged against settings the index did not use."""
    index = "deployed"  # an index of its own: no settings stored on it
    response = stack.live.post(
        f"/v1/indexes/{index}/documents", params={"wait": 20},
        json={"documents": corpus}, headers=ACME,
    )  # fmt: skip
    assert response.status_code == 200 and response.json()["status"] == "succeeded"
    env = {
        "SIFT_FUSION_WEIGHTS": '{"knn": 0.5}',
        "SIFT_FUSION_RANK_CONSTANT": "20",
        "SIFT_RERANK_CANDIDATE_LIMIT": "20",
    }
    report_path = tmp_path / "report.json"
    printed = _sift(stack, "eval", "--tune", "--index", index, "--queries", str(QUERIES),
                    "--qrels", str(QRELS), "--folds", "3", "--out", str(tmp_path / "runs"),
                    "--json", str(report_path), env=env)  # fmt: skip
    report = json.loads(report_path.read_text())
    deployed = Point(1.0, 0.5, 20, 20, "rrf")
    assert report["default"] == report["current"] == deployed.settings(), report
    runs = _runs(tmp_path / "runs")
    fused = [
        ir_measures.ScoredDoc(q, doc, -float(n))
        for q in runs["bm25"]
        for n, doc in enumerate(fuse({c: runs[c].get(q, []) for c in runs}, deployed)[:10])
    ]
    ndcg = ir_measures.calc_aggregate([nDCG @ 10], _qrels(), fused)[nDCG @ 10]
    assert report["held_out"]["default"]["ndcg@10"] == pytest.approx(ndcg, abs=1e-12)
    said = " ".join(printed.split())  # the title wraps at the width
    assert "the deployment's: RRF, weights bm25 1, knn 0.5, k 20, window 20" in said, said
