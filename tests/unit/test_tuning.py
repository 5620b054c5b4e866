"""Tuning the fusion (worker/evaluation/tuning.py) and ``sift eval --tune --apply``'s decision.

The collections here are synthetic: each query's relevant documents sit near the top of an
informative channel's ranking, while a useless channel ranks the corpus in a random order
(what kNN over shuffled vectors gives).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer

from worker.cli import _eval_tune
from worker.cli._http import Gateway
from worker.evaluation.tuning import (
    DEFAULT,
    Fold,
    Grid,
    Measured,
    Point,
    TuneReport,
    fuse,
    split_folds,
    tune,
)

QUERIES = [f"q{n}" for n in range(53)]


def test_every_query_is_held_out_exactly_once_and_the_split_is_deterministic() -> None:
    folds = split_folds(QUERIES, 5, seed=7)
    held = [q for fold in folds for q in fold]
    assert sorted(held) == sorted(QUERIES)  # each exactly once
    assert {len(fold) for fold in folds} == {10, 11}  # sizes within one
    assert split_folds(list(reversed(QUERIES)), 5, seed=7) == folds  # input order is no input
    assert split_folds(QUERIES, 5, seed=8) != folds  # the seed is


@pytest.mark.parametrize("folds", [1, len(QUERIES) + 1])
def test_a_fold_count_the_queries_cannot_fill_is_refused(folds: int) -> None:
    with pytest.raises(ValueError, match="folds"):
        split_folds(QUERIES, folds, seed=0)


def _collection(
    seed: int, queries: int = 150, docs: int = 3000
) -> tuple[
    dict[str, dict[str, int]],
    dict[str, list[tuple[str, float]]],
    dict[str, list[tuple[str, float]]],
]:
    """qrels, an informative ranking (relevant documents in its top 15) and a random one,
    each 100 deep with descending scores, per query."""
    rng = random.Random(seed)
    corpus = [f"d{n}" for n in range(docs)]
    qrels: dict[str, dict[str, int]] = {}
    useful: dict[str, list[tuple[str, float]]] = {}
    useless: dict[str, list[tuple[str, float]]] = {}
    for n in range(queries):
        qid = f"q{n}"
        relevant = rng.sample(corpus, rng.randint(1, 3))
        qrels[qid] = dict.fromkeys(relevant, 1)
        ranking = [d for d in rng.sample(corpus, 120) if d not in relevant]
        for doc in relevant:
            ranking.insert(min(int(rng.expovariate(0.25)), 14), doc)
        scores = sorted((rng.uniform(0, 20) for _ in range(100)), reverse=True)
        useful[qid] = list(zip(ranking[:100], scores, strict=True))
        noise = sorted((rng.uniform(0, 1) for _ in range(100)), reverse=True)
        useless[qid] = list(zip(rng.sample(corpus, 100), noise, strict=True))
    return qrels, useful, useless


@pytest.mark.parametrize("useful_channel", ["bm25", "knn"])
def test_with_one_channel_useless_the_tuned_fusion_holds_out_as_well_as_the_other_alone(
    useful_channel: str,
) -> None:
    qrels, useful, useless = _collection(seed=1)
    other = "knn" if useful_channel == "bm25" else "bm25"
    rankings: Any = {useful_channel: useful, other: useless}
    report = tune(rankings, qrels, Grid(), folds=5, seed=0)
    alone = report.held_out[useful_channel].ndcg
    assert report.best_single[0] == useful_channel
    assert report.held_out[other].ndcg < alone / 4  # the useless channel is useless
    assert report.held_out["default"].ndcg < alone - 0.02  # and plain RRF is hurt by it
    assert report.held_out["tuned"].ndcg >= alone - 0.005
    chosen = report.chosen
    assert getattr(chosen, other) < getattr(chosen, useful_channel)
    assert report.points == len(Grid().points())  # linear points were in the running


def _margins(queries: int = 60) -> tuple[dict[str, dict[str, int]], Any]:
    """Rankings whose order misleads RRF and whose scores do not: per query, one channel
    (either, at random) ranks the relevant document first by a wide score margin and a
    decoy second; the other ranks the decoy first and the relevant document 10th, on flat
    scores. RRF puts the decoy first; min-max normalised scores put the relevant one."""
    rng = random.Random(3)
    qrels: dict[str, dict[str, int]] = {}
    rankings: dict[str, dict[str, list[tuple[str, float]]]] = {"bm25": {}, "knn": {}}
    for n in range(queries):
        qid, relevant, decoy = f"q{n}", f"r{n}", f"x{n}"
        qrels[qid] = {relevant: 1}
        fillers = [f"f{n}-{i}" for i in range(60)]
        sure = [relevant, decoy, *fillers[:38]]
        flat = [decoy, *fillers[30:38], relevant, *fillers[38:]]
        confident, unsure = ("bm25", "knn") if rng.random() < 0.5 else ("knn", "bm25")
        rankings[confident][qid] = [
            (d, 10.0 if i == 0 else 1.0 - i / 1000) for i, d in enumerate(sure)
        ]
        rankings[unsure][qid] = [(d, 1.0 - i / 1000) for i, d in enumerate(flat)]
    return qrels, rankings


def test_the_tuner_chooses_linear_fusion_where_the_score_margins_carry_the_answer() -> None:
    qrels, rankings = _margins()
    report = tune(rankings, qrels, Grid(), folds=5, seed=0)
    assert all(fold.chosen.method == "linear" for fold in report.folds)
    assert report.chosen.method == "linear"
    assert report.held_out["tuned"].ndcg == pytest.approx(1.0)
    assert report.held_out["default"].ndcg < 0.7  # RRF puts the decoy first everywhere
    settings = report.chosen.settings()
    assert settings["fusion"]["method"] == "linear" and settings["fusion"]["rank_constant"] is None
    # only RRF in the grid: the same rankings cannot be fused right
    rrf_only = tune(rankings, qrels, Grid(methods=("rrf",)), folds=5, seed=0)
    assert all(fold.chosen.method == "rrf" for fold in rrf_only.folds)
    assert rrf_only.held_out["tuned"].ndcg < report.held_out["tuned"].ndcg - 0.2


def test_linear_points_with_one_channel_weighted_zero_are_that_channel_alone() -> None:
    bm25 = [(f"b{n}", 50.0 - n) for n in range(60)]
    knn = [(f"k{n}", 0.9 - n / 100) for n in range(60)]
    rankings: Any = {"bm25": bm25, "knn": knn}
    assert fuse(rankings, Point(1.0, 0.0, 60, 10, "linear")) == [d for d, _ in bm25[:10]]
    assert fuse(rankings, Point(0.0, 1.0, 60, 10, "linear")) == [d for d, _ in knn[:10]]


def test_linear_needs_the_scores_and_the_grid_does_not_multiply_it_by_the_rank_constant() -> None:
    with pytest.raises(ValueError, match="scores"):
        fuse({"bm25": ["a"], "knn": ["b"]}, Point.linear(0.5, 10))
    grid = Grid(ratios=(1.0,), rank_constants=(10, 20, 60), windows=(10, 30))
    linear = [p for p in grid.points() if p.method == "linear"]
    assert len(linear) == len(grid.knn_shares) * len(grid.windows)
    assert {p.rank_constant for p in linear} == {60}


def test_the_fused_list_is_cut_where_the_worker_cuts_it() -> None:
    """Each channel at max(4 x coarse, 32), the fused list at coarse = max(10, window)."""
    bm25 = [f"b{n}" for n in range(100)]
    knn = [f"k{n}" for n in range(100)]
    fused = fuse({"bm25": bm25, "knn": knn}, Point(window=10))
    assert len(fused) == 10
    fused = fuse({"bm25": bm25, "knn": knn}, Point(1.0, 1.0, 60, 30))
    assert len(fused) == 30
    # BM25's 41st, kNN's 50th: at window 10 each channel is cut at 40, so only kNN lists
    # it and it scores low; at window 20 (cut at 80) both list it and it comes first
    knn = [*knn[:49], "b40", *knn[49:]]
    assert "b40" not in fuse({"bm25": bm25, "knn": knn}, Point(1.0, 1.0, 60, 10))
    assert fuse({"bm25": bm25, "knn": knn}, Point(1.0, 1.0, 60, 20))[0] == "b40"


def _report(
    tuned: list[float],
    bm25: list[float],
    knn: list[float],
    default: float = 0.5,
    current: tuple[Point, float] | None = None,
) -> TuneReport:
    folds = [
        Fold(10, DEFAULT, Measured(t, 0.9), Measured(default, 0.9), Measured(b, 0.8),
             Measured(k, 0.8))
        for t, b, k in zip(tuned, bm25, knn, strict=True)
    ]  # fmt: skip

    def mean(values: list[float]) -> Measured:
        return Measured(sum(values) / len(values), 0.9)

    chosen = Point(1.0, 0.25, 20, 50)
    held = {"tuned": mean(tuned), "default": mean([default]), "bm25": mean(bm25), "knn": mean(knn)}
    point, score = current or (DEFAULT, default)
    held["current"] = mean([score])
    return TuneReport(
        folds, held, chosen, mean(tuned), points=1, depth={"bm25": 100}, current=point
    )


def test_the_refusal_rule_compares_the_held_out_mean_with_the_better_channel() -> None:
    below = _report(tuned=[0.60, 0.62], bm25=[0.63, 0.63], knn=[0.40, 0.40])
    refusal = below.refusal()
    assert refusal is not None and "bm25 alone (0.6300)" in refusal
    assert below.folds_below_best_single() == [1, 2]
    # above on the mean though below in one fold: applied, and the fold is named
    mixed = _report(tuned=[0.70, 0.62], bm25=[0.63, 0.63], knn=[0.40, 0.40])
    assert mixed.refusal() is None
    assert mixed.folds_below_best_single() == [2]
    # kNN the better channel: compared with kNN
    knn_better = _report(tuned=[0.60, 0.60], bm25=[0.40, 0.40], knn=[0.61, 0.61])
    assert "knn alone" in (knn_better.refusal() or "")


def test_apply_is_refused_below_the_default_the_index_uses_though_above_each_channel() -> None:
    """SciFact, 40 queries, 2 folds: tuned 0.8204 held out, default RRF 0.8253, BM25 alone
    0.8170; --apply stored the tuned settings, worse by the tool's own measure, because it
    compared with the better channel only."""
    below = _report(tuned=[0.8204, 0.8204], bm25=[0.8170, 0.8170], knn=[0.7, 0.7], default=0.8253)
    refusal = below.refusal()
    assert refusal is not None and "default RRF the index uses now (0.8253)" in refusal
    assert "0.8204" in refusal
    # at the default's figure exactly, or above it: applied
    assert _report([0.8253, 0.8253], [0.8170, 0.8170], [0.7, 0.7], default=0.8253).refusal() is None


def test_apply_is_refused_below_the_index_own_settings_not_the_defaults() -> None:
    """An index tuned before keeps its settings when the new tuning scores below them held
    out, though above the defaults; and above them it is applied, though below the
    defaults' figure would not matter."""
    own = Point.linear(0.5, 100)
    below = _report([0.72, 0.72], [0.66, 0.66], [0.6, 0.6], default=0.70, current=(own, 0.73))
    assert "the index's current settings (0.7300)" in (below.refusal() or "")
    above = _report([0.72, 0.72], [0.66, 0.66], [0.6, 0.6], default=0.75, current=(own, 0.71))
    assert above.refusal() is None
    assert above.as_dict()["current"] == own.settings()


def test_the_index_current_settings_are_scored_beside_the_others() -> None:
    """``tune(current=...)`` scores the index's settings on every query, as the defaults."""
    qrels, useful, useless = _collection(seed=3, queries=40, docs=500)
    rankings: Any = {"bm25": useful, "knn": useless}
    own = Point(1.0, 0.125, 20, 50)
    report = tune(rankings, qrels, Grid(windows=(10, 30)), folds=3, current=own)
    assert report.current == own and report.as_dict()["current"] == own.settings()
    assert report.held_out["current"] != report.held_out["default"]
    defaults = tune(rankings, qrels, Grid(windows=(10, 30)), folds=3)
    assert defaults.held_out["current"] == defaults.held_out["default"]


def test_an_index_settings_stand_for_the_point_they_resolve_to() -> None:
    """Each setting the index leaves unset (null, as ``GET /v1/indexes/{index}`` shows it)
    is the default's."""
    unset = {"fusion": {"method": None, "weights": {"bm25": None, "knn": None},
                        "rank_constant": None}, "candidate_limit": None}  # fmt: skip
    assert Point.of_settings(unset) == DEFAULT
    assert Point.of_settings(Point.linear(0.3, 10).settings()) == Point.linear(0.3, 10)
    assert Point.of_settings(Point(1.0, 0.25, 20, 50).settings()) == Point(1.0, 0.25, 20, 50)


@pytest.fixture
def patches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """The gateway ``--apply`` talks to, recording each request; it answers a PATCH as the
    fusion branch's route does (200, the index's metadata with its settings)."""
    sent: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"null")
        sent.append((request.method, request.url.path, body))
        return httpx.Response(200, json={"name": "docs", "settings": body})

    @contextlib.contextmanager
    def fake_gateway() -> Iterator[Gateway]:
        yield Gateway("http://sift.test", "key", transport=httpx.MockTransport(handler))

    monkeypatch.setattr(_eval_tune, "gateway", fake_gateway)
    return sent


def _run_tune(
    monkeypatch: pytest.MonkeyPatch, report: TuneReport, json_out: Path, apply: bool
) -> int:
    monkeypatch.setattr(_eval_tune, "_tune_served", lambda *args: report)
    try:
        _eval_tune._tune_command(
            "docs", Path("q"), Path("r"), None, 5, 0, apply, None, json_out
        )  # fmt: skip
    except typer.Exit as exit_:
        return exit_.exit_code
    return 0


def test_apply_stores_the_chosen_settings(
    monkeypatch: pytest.MonkeyPatch, patches: list[tuple[str, str, Any]], tmp_path: Path
) -> None:
    report = _report(tuned=[0.70, 0.70], bm25=[0.63, 0.63], knn=[0.40, 0.40])
    assert _run_tune(monkeypatch, report, tmp_path / "r.json", apply=True) == 0
    body = {"fusion": {"method": "rrf", "weights": {"bm25": 1.0, "knn": 0.25}, "rank_constant": 20}}
    assert patches == [("PATCH", "/v1/indexes/docs", {**body, "candidate_limit": 50})]
    assert json.loads((tmp_path / "r.json").read_text())["applied"] is True


def test_apply_refuses_below_the_better_channel_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
    patches: list[tuple[str, str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = _report(tuned=[0.60, 0.62], bm25=[0.63, 0.63], knn=[0.40, 0.40])
    refused = _run_tune(monkeypatch, report, tmp_path / "r.json", apply=True)
    assert refused == _eval_tune.EXIT_REFUSED
    assert patches == []
    out, err = capsys.readouterr()  # the refusal with the errors, the folds on stdout
    assert "refused:" in err and "refused:" not in out and "held out" in out, (out, err)
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["applied"] is False and "bm25 alone" in written["refusal"]
    # without --apply the same report is only printed: exit 0, nothing sent
    assert _run_tune(monkeypatch, report, tmp_path / "r.json", apply=False) == 0
    assert patches == []


def test_apply_refuses_below_the_index_current_settings_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch,
    patches: list[tuple[str, str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = _report([0.8204, 0.8204], [0.8170, 0.8170], [0.7, 0.7], default=0.8253)
    assert _run_tune(monkeypatch, report, tmp_path / "r.json", apply=True) == 3
    assert patches == []
    out, err = capsys.readouterr()
    assert "refused:" not in out
    assert "refused:" in err and "default RRF the index uses now" in err, err
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["applied"] is False and "0.8253" in written["refusal"]


def test_a_deployments_default_of_linear_fusion_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch,
    patches: list[tuple[str, str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With ``SIFT_FUSION_METHOD=linear`` the default an index with no settings uses is linear
    fusion: the refusal and the held-out line name it so, not "default RRF"."""
    linear = Point.linear(0.5, 30)
    report = _report([0.8204] * 2, [0.8170] * 2, [0.7] * 2, 0.8253, current=(linear, 0.8253))
    report = replace(report, default=linear)
    assert "the default linear fusion the index uses now (0.8253)" in (report.refusal() or "")
    assert _run_tune(monkeypatch, report, tmp_path / "r.json", apply=False) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "default linear fusion 0.8253" in out and "default RRF" not in out, out
