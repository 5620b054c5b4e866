"""``sift eval``'s input files are read line by line and checked as ``sift ingest`` and
``sift batch`` check theirs: a bad line is one red line naming the file, the line and the
field, exit 1, with no traceback; a qrels file with no judgment, or no judged query, is an
error too (it printed a table of ``nan`` and exited 0).

Before: a queries line without ``query`` was a ``KeyError`` traceback, a result whose
``hits`` was not a list a ``TypeError``, a TREC qrels line of the wrong width Python's
unpacking error, a score that was not an integer ``int()``'s error, a bad corpus line a raw
pydantic dump, and a ``.tsv`` qrels file of malformed rows was read as no judgment at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from worker.cli import app

QUERIES = '{"_id": "q1", "text": "rail"}\n'
QRELS = "query-id\tcorpus-id\tscore\nq1\trail-1\t1\n"


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def eval_(*args: str) -> Result:
    # --index: the files are read and checked before the gateway (none here) is called
    env = {"COLUMNS": "300", "SIFT_URL": "http://127.0.0.1:9", "SIFT_API_KEY": "k"}
    return CliRunner().invoke(app, ["eval", *args], env=env)


def refused(result: Result, message: str) -> None:
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code == 1, result.output
    # on stderr, as every command's errors: ``sift eval ... > report.txt`` printed it there
    assert message in result.stderr and result.stdout == "", result.output
    assert "Traceback" not in result.output


def served(tmp_path: Path, queries: str = QUERIES, qrels: str = QRELS, name: str = "qrels.tsv"):
    return eval_(
        "--index", "s", "--queries", write(tmp_path / "q.jsonl", queries),
        "--qrels", write(tmp_path / name, qrels),
    )  # fmt: skip


def test_a_query_line_without_its_text_names_the_line_and_field(tmp_path: Path) -> None:
    result = served(tmp_path, queries=QUERIES + '{"id": "q2"}\n')
    refused(result, f"{tmp_path / 'q.jsonl'}:2: field 'query': a non-empty string is required")


def test_a_query_line_that_is_not_json_names_the_line(tmp_path: Path) -> None:
    result = served(tmp_path, queries="\n" + QUERIES + "{nope\n")
    refused(result, f"{tmp_path / 'q.jsonl'}:3: not valid JSON")


def test_a_member_given_twice_names_the_line_and_field(tmp_path: Path) -> None:
    """``json.loads`` kept the last of a repeated member: the hit scored was "b"."""
    ok = {"query_id": "q1", "status": "succeeded", "result": {"hits": []}}
    bad = '{"query_id": "q2", "status": "succeeded", "result": {"hits": [{"id": "a", "id": "b"}]}}'
    results = write(tmp_path / "r.jsonl", f"{json.dumps(ok)}\n{bad}\n")
    result = eval_("--results", results, "--qrels", write(tmp_path / "qrels.tsv", QRELS))
    refused(result, f"{results}:2: field 'result.hits.0.id': is given 2 times: give it once")
    result = served(tmp_path, queries=QUERIES + '{"id": "q2", "query": "a", "query": "b"}\n')
    refused(result, f"{tmp_path / 'q.jsonl'}:2: field 'query': is given 2 times: give it once")


def test_a_result_whose_hits_are_not_a_list_names_the_line_and_field(tmp_path: Path) -> None:
    ok = {"query_id": "q1", "status": "succeeded", "result": {"hits": []}}
    bad = {"query_id": "q2", "status": "succeeded", "result": {"hits": "x"}}
    results = write(tmp_path / "r.jsonl", f"{json.dumps(ok)}\n{json.dumps(bad)}\n")
    result = eval_("--results", results, "--qrels", write(tmp_path / "qrels.tsv", QRELS))
    refused(result, f"{results}:2: field 'result.hits': Input should be a valid list")


def test_a_hit_without_an_id_names_the_line_and_field(tmp_path: Path) -> None:
    bad = {"query_id": "q1", "status": "succeeded", "result": {"hits": [{"ranks": {}}]}}
    results = write(tmp_path / "r.jsonl", json.dumps(bad) + "\n")
    result = eval_("--results", results, "--qrels", write(tmp_path / "qrels.tsv", QRELS))
    refused(result, f"{results}:1: field 'result.hits.0.id': Field required")


def test_a_trec_qrels_line_of_the_wrong_width_names_the_line(tmp_path: Path) -> None:
    result = served(tmp_path, qrels="q1 0 rail-1 1\nq1 rail-2\n", name="qrels.txt")
    refused(result, f"{tmp_path / 'qrels.txt'}:2: 2 columns: TREC qrels have 4")


def test_beir_qrels_named_txt_say_that_a_tsv_name_reads_them(tmp_path: Path) -> None:
    result = served(tmp_path, name="qrels.txt")
    refused(result, f"{tmp_path / 'qrels.txt'}:1: 3 columns: TREC qrels have 4")
    assert "a .tsv name" in result.output


@pytest.mark.parametrize(
    ("name", "qrels", "message"),
    [
        ("qrels.tsv", QRELS + "q1\trail-2\thigh\n", ":3: field 'score': an integer is required"),
        ("qrels.txt", "q1 0 rail-1 1.5\n", ":1: field 'relevance': an integer is required"),
    ],
)
def test_a_score_that_is_not_an_integer_names_the_line_and_field(
    tmp_path: Path, name: str, qrels: str, message: str
) -> None:
    refused(served(tmp_path, qrels=qrels, name=name), f"{tmp_path / name}{message}")


def test_a_tsv_qrels_file_of_malformed_rows_names_the_first(tmp_path: Path) -> None:
    result = served(tmp_path, qrels="query-id\tcorpus-id\tscore\nq1 rail-1\nq1 rail-2\n")
    refused(result, f"{tmp_path / 'qrels.tsv'}:2: 2 columns: BEIR qrels have 3")


def test_qrels_with_no_judgment_are_an_error(tmp_path: Path) -> None:
    result = served(tmp_path, qrels="query-id\tcorpus-id\tscore\nq1\trail-1\t0\n")
    refused(result, f"{tmp_path / 'qrels.tsv'}: no relevance judgment (a score of 1 or more)")


def test_no_judged_query_is_an_error_for_every_source(tmp_path: Path) -> None:
    corpus = write(tmp_path / "c.jsonl", '{"id": "rail-1", "text": "rail"}\n')
    queries = write(tmp_path / "q.jsonl", '{"_id": "q9", "text": "rail"}\n')
    qrels = write(tmp_path / "qrels.tsv", QRELS)
    message = f"{queries}: no query has a relevant document in {qrels}"
    refused(eval_("--index", "s", "--queries", queries, "--qrels", qrels), message)
    data = str(tmp_path / "index")
    corpus_eval = eval_(
        "--corpus", corpus, "--queries", queries, "--qrels", qrels, "--data-dir", data
    )
    refused(corpus_eval, message)


def test_a_bad_corpus_line_names_the_line_and_field(tmp_path: Path) -> None:
    corpus = write(tmp_path / "c.jsonl", '{"id": "rail-1", "text": "rail"}\n{"id": "rail-2"}\n')
    result = eval_(
        "--corpus", corpus, "--queries", write(tmp_path / "q.jsonl", QUERIES),
        "--qrels", write(tmp_path / "qrels.tsv", QRELS), "--data-dir", str(tmp_path / "index"),
    )  # fmt: skip
    refused(result, f"{corpus}:2: field 'text': Field required")
    assert "validation error" not in result.output  # pydantic's own dump


def test_a_beir_corpus_line_with_a_title_and_no_text_is_read_as_sift_ingest_sends_it(
    tmp_path: Path,
) -> None:
    """``--corpus`` reads a BEIR document with a title and an empty text as ``sift ingest``
    sends it (its title as its text), so the in-process figures are the served index's; it
    stopped at such a line (``field 'text'``)."""
    from worker.evaluation.inputs import read_corpus

    corpus = write(tmp_path / "c.jsonl", '{"_id": 7, "title": "Aspirin", "text": ""}\n')
    (document,) = read_corpus(Path(corpus))
    assert (document.id, document.title, document.text) == ("7", "", "Aspirin")


def _strict_json(text: str) -> object:
    """``text`` as JSON, refusing Python's NaN and Infinity (no JSON parser but Python's
    reads them: jq, JavaScript and Go stop on them)."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_window_holding_no_relevant_candidate_is_valid_json_and_no_nan(tmp_path: Path) -> None:
    """The conditional row averages over the queries whose window holds a relevant
    candidate; with none, ir-measures' mean is NaN. ``--json`` wrote it as ``NaN`` (not
    JSON: ``jq`` refused the report) and the table printed ``nan``; now it is ``null``
    and ``–``, as for any measure with no query to average."""
    hits = [{"id": "x", "ranks": {"final": 1, "rrf": 1, "bm25": 1, "knn": 1}}]
    item = {"query_id": "q1", "status": "succeeded", "result": {"hits": hits}}
    results = write(tmp_path / "r.jsonl", json.dumps(item) + "\n")
    report = tmp_path / "report.json"
    qrels = write(tmp_path / "qrels.tsv", QRELS)
    result = eval_("--results", results, "--qrels", qrels, "--json", str(report))
    assert result.exit_code == 0, result.output
    runs = _strict_json(report.read_text())["runs"]  # type: ignore[index]
    assert runs["final, conditional on the window"] == dict.fromkeys(runs["fused"])
    assert runs["fused"]["nDCG@10"] == 0.0  # a query that found nothing relevant scores 0
    assert "nan" not in result.output.lower(), result.output


def test_a_data_dir_it_cannot_make_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    """``mkdir``'s ``NotADirectoryError`` (a path under a file) was a traceback of 106 lines."""
    (tmp_path / "a-file").write_text("")
    data = tmp_path / "a-file" / "index"
    result = eval_(
        "--corpus", write(tmp_path / "c.jsonl", '{"id": "rail-1", "text": "rail"}\n'),
        "--queries", write(tmp_path / "q.jsonl", QUERIES),
        "--qrels", write(tmp_path / "qrels.tsv", QRELS), "--data-dir", str(data),
    )  # fmt: skip
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code == 2, result.output
    assert f"--data-dir {data}: cannot make it" in result.stderr, result.output
    assert result.stdout == "", result.output


def test_a_tune_whose_gateway_does_not_answer_says_so_on_stderr(tmp_path: Path) -> None:
    result = eval_(
        "--tune", "--index", "s", "--queries", write(tmp_path / "q.jsonl", QUERIES),
        "--qrels", write(tmp_path / "qrels.tsv", QRELS), "--folds", "2",
    )  # fmt: skip
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
    assert "error:" in result.stderr and result.stdout == "", result.output


def test_a_query_id_given_twice_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    """Two lines of one id: the header said 2 queries while 1 was averaged (the scores keyed
    by id), with no word of it, in-process; the gateway refused the batch."""
    queries = QUERIES + '{"_id": "q1", "text": "rail again"}\n'
    result = served(tmp_path, queries=queries)
    refused(result, f"{tmp_path / 'q.jsonl'}:2: field '_id': 'q1' appears twice (first at line 1)")
    corpus = write(tmp_path / "corpus.jsonl", '{"_id": "rail-1", "text": "rail"}\n')
    result = eval_(
        "--corpus", corpus, "--queries", str(tmp_path / "q.jsonl"),
        "--qrels", str(tmp_path / "qrels.tsv"), "--data-dir", str(tmp_path / "index"),
    )  # fmt: skip
    refused(result, f"{tmp_path / 'q.jsonl'}:2: field '_id': 'q1' appears twice (first at line 1)")
    assert not (tmp_path / "index" / "indexed.ok").exists()  # refused before any indexing


def test_a_result_line_repeated_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    ok = {"query_id": "q1", "status": "succeeded", "result": {"hits": []}}
    results = write(tmp_path / "r.jsonl", f"{json.dumps(ok)}\n{json.dumps(ok)}\n")
    result = eval_("--results", results, "--qrels", write(tmp_path / "qrels.tsv", QRELS))
    refused(result, f"{results}:2: field 'query_id': 'q1' appears twice (first at line 1)")


def test_an_output_it_cannot_write_is_refused_before_anything_is_run(tmp_path: Path) -> None:
    """``--json`` under a folder that is not there, ``--out`` under a file: each was a
    ``FileNotFoundError`` or ``FileExistsError`` traceback once the report was printed, after
    every run's searches (and a reranked run's model calls) had been made and billed."""
    (tmp_path / "a-file").write_text("")
    report = tmp_path / "no-such-folder" / "report.json"
    item = {"query_id": "q1", "status": "succeeded", "result": {"hits": []}}
    results = write(tmp_path / "r.jsonl", json.dumps(item) + "\n")
    qrels = write(tmp_path / "qrels.tsv", QRELS)
    result = eval_("--results", results, "--qrels", qrels, "--json", str(report))
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert f"--json: cannot write {report} (" in result.stderr, result.output
    # --index: refused before the gateway (none here) is called
    for option, path in (("--json", report), ("--out", tmp_path / "a-file")):
        result = eval_(
            "--index", "s", "--queries", write(tmp_path / "q.jsonl", QUERIES),
            "--qrels", qrels, option, str(path),
        )  # fmt: skip
        assert isinstance(result.exception, SystemExit), result.exception
        assert result.exit_code == 2 and result.stdout == "", result.output
        assert f"{option}: cannot write {path} (" in result.stderr, result.output
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in result.stderr, result.output
