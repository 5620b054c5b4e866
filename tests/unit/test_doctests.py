"""Every example in a docstring of Sift's own modules runs, and holds (``make test`` runs
``tests/`` only, so without this the examples could go stale unnoticed)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import api_gateway
import worker


def runs(example: doctest.Example) -> bool:
    """Whether doctest runs ``example`` (one marked ``+SKIP`` only illustrates)."""
    return not example.options.get(doctest.SKIP, False)


def modules_with_examples() -> list[str]:
    names = []
    for package in (worker, api_gateway):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue  # running it is the CLI itself
            tests = doctest.DocTestFinder().find(importlib.import_module(info.name))
            if any(runs(example) for test in tests for example in test.examples):
                names.append(info.name)
    return names


MODULES = modules_with_examples()


def test_the_examples_are_found() -> None:
    evaluation = {"tuning", "inputs", "scoring", "served"}
    assert {"worker.core.fusion"} | {f"worker.evaluation.{m}" for m in evaluation} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_hold(name: str) -> None:
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(importlib.import_module(name)):
        runner.run(test)
    failed, tried = runner.summarize(verbose=False)
    assert tried > 0 and failed == 0
