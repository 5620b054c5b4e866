"""``sift tenant purge``'s table names every kind of thing the purge counted: a purge that only
deleted the tenant's index sizes printed a table of zeros under "purged"."""

from __future__ import annotations

from collections import Counter

import pytest

from worker.cli import tenants


def test_every_kind_counted_is_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    deleted = Counter({"index sizes": 2, "a kind a later release counts": 3})
    tenants._show("acme", Counter(), Counter(), deleted)
    rows = {
        cells[1].strip(): cells[2].strip()
        for line in capsys.readouterr().out.splitlines()
        if len(cells := line.split("│")) == 4
    }
    assert rows["index sizes deleted"] == "2", rows
    assert rows["a kind a later release counts deleted"] == "3", rows
