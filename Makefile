# Sift: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist processes for `make test`; each test file runs whole on one of them, and every
# test starts its own services on free ports, so two files never share a Redis or a worker.
# --no-loadscope-reorder: files are handed out in testpaths order (the longest first, see
# pyproject.toml); xdist's default reorders them by test count, the one-test reliability runs last.
# Six on two cores: the tests' durations sum to about 6,250 s (dead-worker checks, poll
# cadences, sweeps at their defaults; the clean-clone CI of 33e4afa on a quiet machine: pytest
# 18 min 9 s, 3,856 passed), so the run is bound by that sum over the xdist processes (about
# 1,040 s each), not by one file (the longest, test_worker_recovery.py, 6.5 minutes); the order
# of testpaths is within 1.3% of handing every file out longest first (a simulation of that
# run's durations). Its processes used 27.2 CPU-min (user+sys, `time`) over its 19 min, 71% of
# the two cores. Where the CPU goes (one run recording each Python process's own CPU, on 33e4afa
# beside other test runs, load 10 to 48): the `sift worker` processes half (about 355 starts;
# one with a generation model takes 2.4 CPU-s to its warm-up's end, 1.4 of them the SDK's
# `import anthropic`, one without 0.9), the six xdist processes a quarter (their collection
# about 10 CPU-s each, then the in-process tests), the gateways an eighth (about 160 starts).
# Eight would bring the sum over the processes to about 780 s, but only with about a quarter
# less CPU than now: at 71% of the cores in 19 min, the same CPU in 13 would starve them.
# Measured on one machine under the same outside load (about 10), when the sum was about 5,000 s:
# four took 1,067 s, six 762 s (29% less, every test passed); eight took 763 s, its tests'
# durations summing a third more, and three timing-bound tests failed: the CPU was starved.
TEST_WORKERS ?= 6
# pytest caches its assertion rewrites, and Python the bytecode of the ~350 worker, gateway and
# CLI processes the tests start, only where bytecode may be written: with
# PYTHONDONTWRITEBYTECODE set (it is on some machines) each process compiled everything again.
# The collection run beside mypy fills the cache the xdist processes then read: their
# collection took 142 CPU-s on a clean clone, 69 with the cache warm.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench install services clean

# A .venv without pip is made again: `python3 -m venv` leaves one, python but no pip, where the
# venv module is not installed (Debian, Ubuntu: python3-venv), and stops at ensurepip.
$(STAMP): pyproject.toml
	test -x $(BIN)/pip || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The services the tests and the demo start on their own: installed here if missing.
services:
	@./scripts/install-services.sh

demo: install services
	$(BIN)/sift demo

test: install services
	$(BIN)/ruff check worker api_gateway tests benchmarks
	$(BIN)/lint-imports
	$(TEST_ENV) $(BIN)/python -m pytest -q --collect-only > /dev/null & $(BIN)/mypy && wait $$!
	$(TEST_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

lint: install
	$(BIN)/ruff check worker api_gateway tests benchmarks
	$(BIN)/ruff format --check worker api_gateway
	$(BIN)/lint-imports
	$(BIN)/mypy

# Every benchmark, each printing Sift and its baseline side by side (tens of minutes).
bench: install services
	$(BIN)/python benchmarks/bench_pipeline_cpu.py
	$(BIN)/python benchmarks/bench_prompt_tokens.py --queries 300
	$(BIN)/python benchmarks/bench_retrieval.py --scifact-vectors .sift/scifact_vecs.npy
	$(BIN)/python benchmarks/bench_queue.py all
	$(BIN)/python benchmarks/bench_lanes.py --queries 1000 --batch-processing-seconds 60
	$(BIN)/python benchmarks/bench_faults.py --repeat 5
	$(BIN)/python benchmarks/bench_load.py --rate 20 --duration 60 --model-delay 0.5

# The venv and the tools' caches; never .sift, which holds `sift up`'s default data folder
# (.sift/data: the index, Redis's AOF, the development key): delete that by hand.
clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
