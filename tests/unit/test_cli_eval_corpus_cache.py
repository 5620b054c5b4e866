"""``sift eval --corpus``'s index cache under ``.sift/eval/`` is keyed by the corpus's bytes:
an edited corpus at the same path is indexed again, not scored on the index of its old
contents (it was keyed by the path, and a stale index gave the old figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from worker.cli import app

SAMPLE = Path(__file__).parents[2] / "worker" / "data"


def _fused_recall(tmp_path: Path) -> float:
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        ["eval", "--corpus", "c.jsonl", "--queries", str(SAMPLE / "sample_queries.jsonl"),
         "--qrels", "qrels.tsv", "--json", str(report)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # the bars (the indexing's, each run's) on stderr, the report alone on stdout
    assert "indexing c.jsonl" in result.stderr and "run fused" in result.stderr, result.stderr
    assert "indexing" not in result.stdout and "run fused" not in result.stdout, result.stdout
    assert "MRR@10" in result.stdout, result.stdout
    data = json.loads(report.read_text())
    # the keys --index and --results give too: a script reads one report shape (the in-process
    # run stops at its first failed search, so none failed in a report it writes)
    assert data["failed"] == 0 and data["errors"] == {}, data
    assert data["failed_by_run"] == dict.fromkeys(data["runs"], 0), data
    return float(data["runs"]["fused"]["R@10"])


def test_an_edited_corpus_is_indexed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the cache is .sift/eval/ under the working directory
    lines = (SAMPLE / "sample_corpus.jsonl").read_text().splitlines(keepends=True)
    Path("qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\trail-1\t1\n")
    Path("c.jsonl").write_text("".join(lines))
    assert _fused_recall(tmp_path) == 1.0

    Path("c.jsonl").write_text("".join(line for line in lines if '"rail-1"' not in line))
    assert _fused_recall(tmp_path) == 0.0  # rail-1 is no longer in the corpus
    assert len(list(Path(".sift/eval").iterdir())) == 2  # the first contents' cache is kept


def test_a_data_dir_of_other_contents_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit --data-dir that holds another version's index names the option, exit 2."""
    monkeypatch.chdir(tmp_path)
    lines = (SAMPLE / "sample_corpus.jsonl").read_text().splitlines(keepends=True)
    Path("qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\trail-1\t1\n")
    args = ["eval", "--corpus", "c.jsonl", "--queries", str(SAMPLE / "sample_queries.jsonl"),
            "--qrels", "qrels.tsv", "--data-dir", "index"]  # fmt: skip
    Path("c.jsonl").write_text("".join(lines))
    assert CliRunner().invoke(app, args).exit_code == 0
    Path("c.jsonl").write_text("".join(lines[1:]))
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "--data-dir index holds the index of other contents than c.jsonl" in result.output
