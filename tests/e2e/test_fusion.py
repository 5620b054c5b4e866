"""Weighted RRF and linear fusion over the real stack: an index's own settings (PATCH, GET,
the list, a drop), tenant-scoped; a search's own fusion; the 4xx that name the field; a
hybrid search with kNN weighted 0 ranks exactly as the fts mode; ``sift index set``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.e2e.conftest import ACME, GLOBEX, INDEX, SAMPLE, Stack, ingest
from worker.cli import app

DEFAULTS = {
    "fusion": {"method": None, "weights": {"bm25": None, "knn": None}, "rank_constant": None},
    "candidate_limit": None,
}
DOCS = [
    {"id": "f1", "text": "marmot burrows in alpine meadows"},
    {"id": "f2", "text": "alpine choughs nest on cliffs"},
    {"id": "f3", "text": "meadow saffron blooms in autumn"},
]
QUERIES = [
    "what do marmots eat in winter",
    "alpine birds nesting",
    "flowers that bloom in autumn",
    "glacier melt and sea level",
    "volcanic eruption ash cloud",
]


def _patch(stack: Stack, index: str, body: Any, headers: Any = ACME) -> Any:
    return stack.live.patch(f"/v1/indexes/{index}", json=body, headers=headers)


def _search(stack: Stack, **spec: Any) -> dict[str, Any]:
    body = {"index": INDEX, "limit": 10, "include_trace": True, **spec}
    response = stack.live.post("/v1/searches", params={"wait": 20}, json=body, headers=ACME)
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "succeeded", job
    return dict(job["result"])


def test_patch_stores_the_settings_and_get_and_the_list_show_them(stack: Stack) -> None:
    ingest(stack, "fusion-meta", DOCS)
    assert stack.live.get("/v1/indexes/fusion-meta", headers=ACME).json()["settings"] == DEFAULTS
    body = {
        "fusion": {"weights": {"bm25": 1, "knn": 0.3}, "rank_constant": 20},
        "candidate_limit": 45,
    }
    response = _patch(stack, "fusion-meta", body)
    assert response.status_code == 200, response.text
    stored = {
        "fusion": {"method": None, "weights": {"bm25": 1.0, "knn": 0.3}, "rank_constant": 20},
        "candidate_limit": 45,
    }
    assert response.json()["name"] == "fusion-meta" and response.json()["documents"] == 3
    assert response.json()["settings"] == stored
    assert stack.live.get("/v1/indexes/fusion-meta", headers=ACME).json()["settings"] == stored
    listed = {i["name"]: i for i in stack.live.get("/v1/indexes", headers=ACME).json()["indexes"]}
    assert listed["fusion-meta"]["settings"] == stored

    # a field left out stays; null clears one field; an empty patch changes nothing
    cleared = _patch(stack, "fusion-meta", {"fusion": {"weights": {"knn": None}}}).json()
    assert cleared["settings"]["fusion"] == {
        "method": None,
        "weights": {"bm25": 1.0, "knn": None},
        "rank_constant": 20,
    }
    assert cleared["settings"]["candidate_limit"] == 45
    assert _patch(stack, "fusion-meta", {}).json()["settings"] == cleared["settings"]

    # the search uses them, and the trace says which level each value came from
    trace = _search(stack, index="fusion-meta", query="alpine marmot")["trace"]
    assert trace["fusion"]["weights"] == {"bm25": 1.0, "knn": 1.0}
    assert trace["fusion"]["rank_constant"] == 20
    assert trace["fusion"]["from"] == {
        "method": "default",
        "weights": {"bm25": "index", "knn": "default"},
        "rank_constant": "index",
    }
    assert trace["candidate_limit"] == {"value": 45, "from": "index"}
    assert trace["fusion"]["method"] == "rrf"

    # the method likewise: stored, shown, used, and a request's own wins over it
    linear = _patch(stack, "fusion-meta", {"fusion": {"method": "linear"}}).json()
    assert linear["settings"]["fusion"]["method"] == "linear"
    assert linear["settings"]["fusion"]["rank_constant"] == 20  # the other fields stay
    result = _search(stack, index="fusion-meta", query="alpine marmot")
    assert result["trace"]["fusion"]["method"] == "linear"
    assert result["trace"]["fusion"]["from"]["method"] == "index"
    top = result["hits"][0]["scores"]["rrf"]
    assert 1.0 <= top <= 2.0  # a channel's best scores its weight, 1; at most 1 + 1
    asked = _search(stack, index="fusion-meta", query="alpine marmot", fusion={"method": "rrf"})
    assert asked["trace"]["fusion"]["method"] == "rrf"
    assert asked["trace"]["fusion"]["from"]["method"] == "request"
    assert asked["hits"][0]["scores"]["rrf"] <= 2 / 21  # an RRF score, rank constant 20
    unset = _patch(stack, "fusion-meta", {"fusion": {"method": None}}).json()
    assert unset["settings"]["fusion"]["method"] is None

    # every field back to null: the defaults again
    reset = _patch(stack, "fusion-meta", {"fusion": None, "candidate_limit": None})
    assert reset.json()["settings"] == DEFAULTS


def test_settings_are_the_tenants_own(stack: Stack) -> None:
    ingest(stack, "fusion-shared", DOCS)
    assert _patch(stack, "fusion-shared", {"candidate_limit": 50}).status_code == 200

    # globex has no index of that name: the same 404 as for a name nobody has
    theirs = _patch(stack, "fusion-shared", {"candidate_limit": 5}, headers=GLOBEX)
    nobody = _patch(stack, "fusion-nobody", {"candidate_limit": 5}, headers=GLOBEX)
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["error"]["type"] == nobody.json()["error"]["type"] == "index_not_found"
    assert stack.live.get("/v1/indexes/fusion-shared", headers=GLOBEX).status_code == 404

    # once globex has its own index of the name, each sees and changes only its own
    ingest(stack, "fusion-shared", DOCS[:1], GLOBEX)
    shown = stack.live.get("/v1/indexes/fusion-shared", headers=GLOBEX).json()
    assert shown["documents"] == 1 and shown["settings"] == DEFAULTS
    assert _patch(stack, "fusion-shared", {"candidate_limit": 7}, headers=GLOBEX).status_code == 200
    mine = stack.live.get("/v1/indexes/fusion-shared", headers=ACME).json()
    assert mine["documents"] == 3 and mine["settings"]["candidate_limit"] == 50
    globex = stack.live.get("/v1/indexes", headers=GLOBEX).json()["indexes"]
    assert {i["name"]: i["settings"]["candidate_limit"] for i in globex}["fusion-shared"] == 7


def test_dropping_the_index_clears_its_settings(stack: Stack) -> None:
    ingest(stack, "fusion-drop", DOCS)
    assert _patch(stack, "fusion-drop", {"candidate_limit": 60}).status_code == 200
    dropped = stack.live.delete("/v1/indexes/fusion-drop", params={"wait": 20}, headers=ACME)
    assert dropped.status_code == 200 and dropped.json()["status"] == "succeeded", dropped.text
    ingest(stack, "fusion-drop", DOCS)
    assert stack.live.get("/v1/indexes/fusion-drop", headers=ACME).json()["settings"] == DEFAULTS


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"fusion": {"weights": {"knn": -1}}}, "fusion.weights.knn"),
        ({"fusion": {"weights": {"splade": 1}}}, "fusion.weights.splade"),
        ({"fusion": {"weights": {"bm25": "heavy"}}}, "fusion.weights.bm25"),
        # a weight of another JSON type than a number: it was converted and stored, "false"
        # a weight of 0 that turned kNN off, "2" a weight of 2
        ({"fusion": {"weights": {"knn": False}}}, "fusion.weights.knn"),
        ({"fusion": {"weights": {"bm25": True}}}, "fusion.weights.bm25"),
        ({"fusion": {"weights": {"bm25": "2"}}}, "fusion.weights.bm25"),
        ({"fusion": {"weights": {"bm25": 1e308}}}, "fusion.weights.bm25"),
        ({"fusion": {"weights": {"bm25": 0, "knn": 0}}}, "fusion.weights"),
        ({"fusion": {"rank_constant": 0}}, "fusion.rank_constant"),
        ({"fusion": {"method": "sum"}}, "fusion.method"),
        ({"fusion": {"method": 1}}, "fusion.method"),
        ({"fusion": {"weight": {"bm25": 1}}}, "fusion.weight"),
        ({"candidate_limit": 0}, "candidate_limit"),
        ({"candidate_limit": 201}, "candidate_limit"),
        ({"rank_constant": 10}, "rank_constant"),
    ],
)
def test_a_bad_patch_is_a_422_naming_the_field(
    stack: Stack, corpus: list[dict[str, object]], body: Any, field: str
) -> None:
    response = _patch(stack, INDEX, body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field
    assert stack.live.get(f"/v1/indexes/{INDEX}", headers=ACME).json()["settings"] == DEFAULTS


def test_a_patch_that_leaves_every_weight_zero_is_refused(stack: Stack) -> None:
    ingest(stack, "fusion-zero", DOCS)
    assert _patch(stack, "fusion-zero", {"fusion": {"weights": {"knn": 0}}}).status_code == 200
    response = _patch(stack, "fusion-zero", {"fusion": {"weights": {"bm25": 0}}})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "fusion.weights"
    weights = stack.live.get("/v1/indexes/fusion-zero", headers=ACME).json()["settings"]
    assert weights["fusion"]["weights"] == {"bm25": None, "knn": 0.0}


def test_a_patch_refused_over_the_index_s_settings_lists_its_problem_under_fields(
    stack: Stack,
) -> None:
    """The worker refuses a patch that, merged over the index's settings, weights every
    channel 0: its 422 lists the problem under ``fields``, as every other 422 does (it had
    ``field`` and ``message`` alone, so a client reading ``fields`` found none)."""
    ingest(stack, "fusion-zero-fields", DOCS)
    assert (
        _patch(stack, "fusion-zero-fields", {"fusion": {"weights": {"knn": 0}}}).status_code == 200
    )
    response = _patch(stack, "fusion-zero-fields", {"fusion": {"weights": {"bm25": 0}}})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "fusion.weights" and error["message"].startswith("fusion.weights: ")
    problem = error["message"].removeprefix("fusion.weights: ")
    assert error["fields"] == [{"field": "fusion.weights", "message": problem}], error


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/searches",
            {"query": "q", "fusion": {"weights": {"knn": -0.5}}},
            "fusion.weights.knn",
        ),
        (
            "/v1/searches",
            {"query": "q", "fusion": {"weights": {"dense": 1}}},
            "fusion.weights.dense",
        ),
        ("/v1/searches", {"query": "q", "fusion": {"rank_constant": 0}}, "fusion.rank_constant"),
        (  # linear fusion sums weight x score: 1e308 twice would overflow in the worker
            "/v1/searches",
            {"query": "q", "fusion": {"method": "linear", "weights": {"bm25": 1e308}}},
            "fusion.weights.bm25",
        ),
        ("/v1/searches", {"query": "q", "fusion": {"method": "convex"}}, "fusion.method"),
        (  # no conversion: false was a weight of 0, the kNN channel left out
            "/v1/searches",
            {"query": "q", "fusion": {"weights": {"knn": False}}},
            "fusion.weights.knn",
        ),
        (
            "/v1/searches",
            {"query": "q", "fusion": {"weights": {"bm25": " 0.5 "}}},
            "fusion.weights.bm25",
        ),
        (
            "/v1/batches",
            {"queries": [{"id": "a", "query": "q"}], "fusion": {"weights": {"knn": True}}},
            "fusion.weights.knn",
        ),
        (
            "/v1/batches",
            {"queries": [{"id": "a", "query": "q"}], "fusion": {"method": "RRF"}},
            "fusion.method",
        ),
        ("/v1/searches", {"query": "q", "candidate_limit": 0}, "candidate_limit"),
        (
            "/v1/batches",
            {"queries": [{"id": "a", "query": "q"}], "fusion": {"rank_constant": -3}},
            "fusion.rank_constant",
        ),
        (
            "/v1/batches",
            {"queries": [{"id": "a", "query": "q"}], "fusion": {"weights": {"bm25": 0, "knn": 0}}},
            "fusion.weights",
        ),
    ],
)
def test_a_bad_search_fusion_is_a_422_naming_the_field(
    stack: Stack, path: str, body: dict[str, Any], field: str
) -> None:
    response = stack.live.post(path, json={"index": INDEX, **body}, headers=ACME)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_hybrid_with_knn_weighted_zero_ranks_exactly_as_fts(
    stack: Stack, corpus: list[dict[str, object]]
) -> None:
    differs = 0
    for query in QUERIES:
        fts = _search(stack, query=query, mode="fts")
        weighted = _search(stack, query=query, fusion={"weights": {"knn": 0}})
        plain = _search(stack, query=query)
        assert [h["id"] for h in weighted["hits"]] == [h["id"] for h in fts["hits"]], query
        assert all(h["ranks"]["knn"] is None for h in weighted["hits"])
        assert weighted["trace"]["fusion"]["weights"] == {"bm25": 1.0, "knn": 0.0}
        assert weighted["trace"]["fusion"]["channels"] == ["bm25"]
        assert "knn" not in weighted["trace"]["channel_counts"]
        differs += [h["id"] for h in plain["hits"]] != [h["id"] for h in fts["hits"]]
    assert differs, "plain hybrid ranked every query as fts: the comparison shows nothing"


def test_an_index_weighting_knn_zero_makes_hybrid_its_bm25(stack: Stack) -> None:
    lines = (SAMPLE / "sample_corpus.jsonl").read_text().splitlines()
    docs = [{"id": d["id"], "text": d["text"]} for d in map(json.loads, filter(None, lines))]
    ingest(stack, "fusion-bm25", docs)
    assert _patch(stack, "fusion-bm25", {"fusion": {"weights": {"knn": 0}}}).status_code == 200
    for query in QUERIES[:3]:
        fts = _search(stack, index="fusion-bm25", query=query, mode="fts")
        hybrid = _search(stack, index="fusion-bm25", query=query)
        assert [h["id"] for h in hybrid["hits"]] == [h["id"] for h in fts["hits"]], query
        assert hybrid["trace"]["fusion"]["from"]["weights"]["knn"] == "index"


def test_sift_index_set(stack: Stack) -> None:
    ingest(stack, "fusion-cli", DOCS)
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": stack.live_url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    runner = CliRunner()
    args = ["index", "set", "fusion-cli", "--knn-weight", "0.4", "--rank-constant", "30"]
    result = runner.invoke(app, [*args, "--candidate-limit", "25", "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"] == {
        "fusion": {"method": None, "weights": {"bm25": None, "knn": 0.4}, "rank_constant": 30},
        "candidate_limit": 25,
    }
    table = runner.invoke(app, ["index", "show", "fusion-cli"], env=env)
    assert table.exit_code == 0 and "knn weight 0.4" in table.stdout, table.output
    method = runner.invoke(app, ["index", "set", "fusion-cli", "--method", "linear"], env=env)
    assert method.exit_code == 0 and "linear fusion" in method.stdout, method.output
    shown = runner.invoke(app, ["index", "show", "fusion-cli", "--json"], env=env)
    assert json.loads(shown.stdout)["settings"]["fusion"]["method"] == "linear"
    wrong = runner.invoke(app, ["index", "set", "fusion-cli", "--method", "sum"], env=env)
    assert wrong.exit_code != 0 and "--method" in wrong.output
    bad = runner.invoke(app, ["index", "set", "fusion-cli", "--knn-weight", "-1"], env=env)
    assert bad.exit_code == 2 and "'--knn-weight'" in bad.output  # a usage error, not sent
    assert "fusion.weights.knn" not in bad.output  # the API's field, not the option
    reset = runner.invoke(app, ["index", "set", "fusion-cli", "--reset", "--json"], env=env)
    assert reset.exit_code == 0 and json.loads(reset.stdout)["settings"] == DEFAULTS


def test_a_weight_of_minus_zero_is_stored_and_shown_as_zero(stack: Stack) -> None:
    """``-0.0`` is a weight of 0 (JSON lets a number be negative zero; Python's ``>= 0`` takes
    it): an index's setting and a search's own weight were stored and shown as ``-0.0``, a
    sign a weight never has. Each is now ``0.0``, and still turns its channel off."""
    ingest(stack, "fusion-minus-zero", DOCS)
    patched = _patch(stack, "fusion-minus-zero", {"fusion": {"weights": {"knn": -0.0}}})
    assert patched.status_code == 200, patched.text
    shown = stack.live.get("/v1/indexes/fusion-minus-zero", headers=ACME)
    for answer in (patched, shown):
        assert "-0.0" not in answer.text, answer.text
        assert answer.json()["settings"]["fusion"]["weights"]["knn"] == 0.0
    body = {"index": "fusion-minus-zero", "query": "marmots", "limit": 3, "include_trace": True,
            "fusion": {"weights": {"bm25": 1, "knn": -0.0}}}  # fmt: skip
    searched = stack.live.post("/v1/searches", params={"wait": 20}, json=body, headers=ACME)
    assert searched.status_code == 200 and searched.json()["status"] == "succeeded", searched.text
    assert "-0.0" not in searched.text, searched.text
    assert searched.json()["result"]["trace"]["fusion"]["weights"] == {"bm25": 1.0, "knn": 0.0}
