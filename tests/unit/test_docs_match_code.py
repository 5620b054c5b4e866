"""The README and docs/ say what the code does: the Settings table (every setting, its
default), the ``sift`` commands and flags they, ``deploy/README.md`` and
``benchmarks/README.md`` show, the metrics table (names and labels), the HTTP routes, files
and tests they name, and the ``SIFT_`` variables ``deploy/`` sets.

Each check reads the documents as a newcomer would and compares them with the objects the
code runs on (the settings class, the typer app, the Prometheus metrics, the OpenAPI
document), so a setting, flag or label added, renamed or dropped on one side only fails
here, not in a user's terminal."""

from __future__ import annotations

import ast
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer.main
from prometheus_client.metrics import MetricWrapperBase

from api_gateway.app import create_app
from api_gateway.metrics import GatewayMetrics
from worker.cli import app
from worker.observability import metrics
from worker.settings import DAY, NOT_SETTINGS, Settings

ROOT = Path(__file__).resolve().parents[2]
# the README and the docs/ files its sections moved to (one text for the checks over all of it)
README_AND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDES = {
    "README.md and docs/": README_AND_DOCS,
    "deploy/README.md": [ROOT / "deploy" / "README.md"],
    "benchmarks/README.md": [ROOT / "benchmarks" / "README.md"],
}


def read(guide: str) -> str:
    return "\n".join(path.read_text() for path in GUIDES[guide])


VARIABLE = re.compile(r"`(SIFT_[A-Z0-9_]+)`")
# deploy-only variables: compose's image tag, KEDA's Redis address (read by no Sift process,
# which lets them be: a SIFT_ variable that is no setting is refused at start-up)
DEPLOY_ONLY = NOT_SETTINGS


def section(title: str) -> str:
    """The section under ``title`` (a ``## `` heading) in the README or the docs/ file it
    moved to, up to the next one."""
    for path in README_AND_DOCS:
        text = path.read_text()
        start = text.find(f"\n## {title}\n")
        if start != -1:
            end = text.find("\n## ", start + 1)
            return text[start : end if end != -1 else None]
    raise AssertionError(f"no '## {title}' section in README.md or docs/")


def settings_rows() -> list[tuple[list[str], str]]:
    """Each row of the Settings table: its variables and its default cell."""
    rows = []
    for line in section("Settings").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `SIFT_") and len(cells) == 3:
            rows.append((VARIABLE.findall(cells[0]), cells[1]))
    return rows


def env_names() -> dict[str, str]:
    """Every setting's variable, and its field."""
    return {f"SIFT_{name.upper()}": name for name in Settings.model_fields}


def test_every_setting_is_in_the_settings_table_and_every_row_is_a_setting() -> None:
    documented = {name for names, _ in settings_rows() for name in names}
    assert set(env_names()) - documented == set(), "settings missing from the Settings table"
    assert documented - set(env_names()) == set(), "Settings rows that are no setting"


_UNCHECKED = object()


def documented_value(cell: str) -> str | object | None:
    """A default cell's value as text (``unset``: None): a number, ``true``/``false``, or a
    whole backticked cell; anything else (``derived``, ``built-in table``, JSON) is not
    checked. A trailing parenthesis (``0 (no limit)``) is a comment."""
    cell = re.sub(r"\s*\(.*\)$", "", cell.strip())
    if cell == "unset":
        return None
    if re.fullmatch(r"-?\d+(\.\d+)?|true|false", cell):
        return cell
    if re.fullmatch(r"`[^`{]*`", cell):
        return cell.strip("`")
    return _UNCHECKED


def same_default(documented: str | None, actual: Any) -> bool:
    """Whether the docs' text names the code's default, read as the code's type."""
    if documented is None:
        return actual in (None, [], {})
    if isinstance(actual, bool):
        return documented == str(actual).lower()
    if isinstance(actual, int | float):
        return re.fullmatch(r"-?\d+(\.\d+)?", documented) is not None and math.isclose(
            float(documented), actual
        )
    if isinstance(actual, Path):
        return Path(documented).expanduser() == actual
    return bool(documented == actual)


def test_the_settings_table_gives_each_setting_s_default() -> None:
    fields = env_names()
    checked = []
    for names, cell in settings_rows():
        parts = [cell] if len(names) == 1 else cell.split(", ")
        if len(parts) == 1:
            parts = parts * len(names)
        assert len(parts) == len(names), f"{names}: {len(parts)} defaults for {len(names)}"
        for name, part in zip(names, parts, strict=True):
            value = documented_value(part)
            if value is _UNCHECKED:
                continue
            assert value is None or isinstance(value, str)
            field = Settings.model_fields[fields[name]]
            actual = field.get_default(call_default_factory=True)
            assert same_default(value, actual), f"{name}: documented {part!r}, code {actual!r}"
            checked.append(name)
    assert len(checked) >= len(fields) - 5, f"only {len(checked)} defaults could be read"


def settings_row_texts() -> dict[str, str]:
    """Each setting's variable, and the whole text of its row in the Settings table."""
    texts = {}
    for line in section("Settings").splitlines():
        if line.startswith("| `SIFT_"):
            cells = line.strip().strip("|").split(" | ")
            texts.update(dict.fromkeys(VARIABLE.findall(cells[0]), line))
    return texts


def whole_number_bounds(name: str) -> list[int]:
    """A whole-number setting's upper bound, and its lower one when it is more than 1 (0 and
    1 are the natural floors: none, or one); no bound for any other setting."""
    field = Settings.model_fields[name]
    if field.annotation not in (int, int | None):
        return []
    upper = [m.le for m in field.metadata if hasattr(m, "le")]
    lower = [m.ge for m in field.metadata if hasattr(m, "ge") and m.ge > 1]
    return [*upper, *lower]


def names_bound(text: str, bound: float) -> bool:
    """Whether ``text`` gives ``bound`` as a bound: the number (with or without thousands
    separators) after "at most", "up to", "to", "from", "least", "≤" or an opening
    parenthesis (``at most a week (604800)``), or before " to " (``2 to 90``); the same
    number as a duration (``the 10 s left``) or a count of something else is none."""
    whole = bound == int(bound)
    numbers = {f"{int(bound)}", f"{int(bound):,}"} if whole else {f"{bound:g}"}
    number = "|".join(re.escape(n) for n in sorted(numbers))
    said = (rf"(?:(?:at most|up to|to|from|least|≤)\s+|\()(?:{number})(?![\d,]*\d)(?! s\b)"
            rf"|(?<![\d,])(?:{number}) to ")  # fmt: skip
    return re.search(said, text) is not None


def test_the_settings_table_gives_each_whole_number_setting_s_bounds() -> None:
    """The table's introduction says every whole-number setting's row gives its bound and
    why; 21 rows gave none (SIFT_WORKER_CONCURRENCY's 5000, SIFT_GATEWAY_PORT's 65535, ...)
    and SIFT_RERANK_CANDIDATE_MAX_CHARS not its least, 50. SIFT_GENERATION_MAX_REQUESTS's 10
    was missing too, unseen while any 10 passed (its row's "the 10 s left")."""
    rows = settings_row_texts()
    missing = []
    for variable, name in env_names().items():
        for bound in whole_number_bounds(name):
            if not names_bound(rows[variable], bound):
                missing.append(f"{variable}: {bound}")
    assert missing == [], f"bounds not in their Settings rows: {missing}"
    bounded = [name for name in env_names().values() if whole_number_bounds(name)]
    assert len(bounded) >= 30, bounded  # the check reads the fields' bounds at all


def float_upper_bound(name: str) -> float | None:
    """A number setting's upper bound, when the table's introduction does not give it: a
    duration's day (86400) it does, for every one."""
    field = Settings.model_fields[name]
    if field.annotation not in (float, float | None):
        return None
    upper = [m.le for m in field.metadata if hasattr(m, "le")]
    upper += [m.lt for m in field.metadata if hasattr(m, "lt")]
    return upper[0] if upper and upper[0] != DAY else None


def test_the_settings_table_gives_each_number_setting_s_bound_past_a_day() -> None:
    """A number setting bounded otherwise than the introduction's day gives its bound in its
    row, or the introduction names it with its bound: SIFT_WORKER_HEARTBEAT_SECONDS's 60 and
    SIFT_WORKER_DEAD_AFTER_SECONDS's 600 were given nowhere, so a value past them stopped a
    start the docs said would do."""
    rows, table = settings_row_texts(), section("Settings")
    introduction = table[: table.index("\n| `SIFT_")]
    missing = []
    for variable, name in env_names().items():
        bound = float_upper_bound(name)
        if bound is None or names_bound(rows[variable], bound):
            continue
        named = re.search(rf"`{variable}`[^`]*?(?:at most|\()", introduction)
        if named is None:
            missing.append(f"{variable}: {bound:g}")
    assert missing == [], f"bounds given nowhere: {missing}"
    assert [n for n in env_names().values() if float_upper_bound(n)], "no bound read at all"


# the commit from which a SIFT_ variable that is no setting stops a Sift process at start
UNKNOWN_FATAL_SINCE = "759419a"


def settings_fields_at(commit: str) -> set[str]:
    """The fields of the Settings class in ``worker/settings.py`` at ``commit`` (read by
    ``git show``, parsed, not imported: that release's code need not import today)."""
    shown = subprocess.run(["git", "show", f"{commit}:worker/settings.py"], cwd=ROOT,
                           capture_output=True, text=True, check=True)  # fmt: skip
    (cls,) = (node for node in ast.parse(shown.stdout).body
              if isinstance(node, ast.ClassDef) and node.name == "Settings")  # fmt: skip
    return {
        node.target.id
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    } - {"model_config"}


def test_rolling_back_names_every_setting_added_since_unknown_ones_stop_a_start() -> None:
    """deploy/README.md's "Rolling back past a setting" lists the settings to unset before a
    rollback: since 759419a a release given one added after it refuses to start. It named 2
    of the 10 added since (SIFT_ELASTICSEARCH_CA_CERTS, SIFT_MAX_INDEXES_PER_TENANT, ...
    were left out), so a rollback past them crash-looped with no word of it here."""
    commit = f"{UNKNOWN_FATAL_SINCE}^{{commit}}"
    git = ["git", "rev-parse", "--verify", "-q", commit]
    if shutil.which("git") is None or subprocess.run(git, cwd=ROOT, capture_output=True).returncode:
        pytest.skip(f"not a git checkout holding {UNKNOWN_FATAL_SINCE}")
    added = set(Settings.model_fields) - settings_fields_at(UNKNOWN_FATAL_SINCE)
    text = read("deploy/README.md")
    start = text.index("**Rolling back past a setting.**")
    paragraph = text[start : text.index("\n\n", start)]
    named = {v.removeprefix("SIFT_").lower() for v in VARIABLE.findall(paragraph)}
    assert sorted(added - named) == [], "added since 759419a, not in the rollback list"
    assert sorted(named - added) == [], "in the rollback list, not added since 759419a"
    assert len(added) >= 10, added  # the check reads the old release's fields at all


def test_deploy_sets_only_real_settings() -> None:
    files = [
        p
        for p in (ROOT / "deploy").rglob("*")
        if p.is_file() and p.suffix in (".yml", ".yaml", ".example", "") and "README" not in p.name
    ]
    assert any(p.name == "docker-compose.yml" for p in files)
    found = {name for p in files for name in re.findall(r"\b(SIFT_[A-Z0-9_]+)", p.read_text())}
    assert found, "no SIFT_ variable found under deploy/"
    assert found - set(env_names()) - DEPLOY_ONLY == set()


# --- the sift command ---------------------------------------------------------------------

COMMAND = typer.main.get_command(app)
# ``sift <words> <arguments and options>`` inside a code span or block; ``-n sift ...`` is
# kubectl's namespace, not this command
SIFT_CALL = re.compile(r"(?<!-n )(?<![\w.-])sift ([a-z][a-z-]*(?: [a-z][a-z-]*)?)([^\n`#]*)")


def code_spans(text: str) -> list[str]:
    blocks = re.findall(r"```.*?```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`]+)`", rest)


def calls(text: str) -> list[tuple[list[str], Any, str]]:
    """Each ``sift`` call shown: the command path, the click command and what follows."""
    found = []
    for span in code_spans(text):
        for match in SIFT_CALL.finditer(span):
            words = match.group(1).split()
            command: Any = COMMAND
            path: list[str] = []
            for word in words:
                commands = getattr(command, "commands", {})
                if word not in commands:
                    break
                command, path = commands[word], [*path, word]
            rest = " ".join(words[len(path) :]) + match.group(2)
            found.append((path or words, command if path else None, rest))
    return found


@pytest.mark.parametrize("document", list(GUIDES))
def test_every_sift_command_and_flag_shown_exists(document: str) -> None:
    shown = calls(read(document))
    assert len(shown) > (1 if document.startswith("benchmarks/") else 5)
    for path, command, rest in shown:
        assert command is not None, f"{document}: no command `sift {' '.join(path)}`"
        options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-z])\b", rest):
            assert flag in options, f"{document}: `sift {' '.join(path)}` has no {flag}"


def test_every_option_and_argument_says_what_it_is_in_help() -> None:
    def undocumented(command: Any, path: str) -> list[str]:
        missing = [
            f"{path} {p.name}"
            for p in command.params
            if not getattr(p, "hidden", False) and not getattr(p, "help", None)
        ]
        for name, sub in getattr(command, "commands", {}).items():
            missing += undocumented(sub, f"{path} {name}")
        return missing

    assert undocumented(COMMAND, "sift") == []


# --- metrics and routes ---------------------------------------------------------------------


def exported_metrics() -> dict[str, set[str]]:
    """Every metric a worker or the gateway exports, by its exposed name, with its labels."""
    gateway = GatewayMetrics()
    found = [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    found += [gateway.requests, gateway.duration]
    return {m._name + ("_total" if m._type == "counter" else ""): set(m._labelnames) for m in found}


def test_the_metrics_table_names_what_is_exported_with_its_labels() -> None:
    table = section("Observability: what reranking costs, and how it fails")
    table = table[table.index("| metric |") :]
    table = table[: table.index("\n\n")]
    documented = re.findall(r"`(sift_[a-z0-9_]+)(?:\{([a-z_,]*)\})?`", table)
    exported = exported_metrics()
    assert {name for name, _ in documented} == set(exported)
    for name, labels in documented:
        assert labels, f"{name}: give its labels"
        assert set(labels.split(",")) == exported[name], f"{name}: {labels}"


# DESIGN.md §9's metric contract (that file is outside this repository): each metric's type,
# its labels, and the values of the labels it enumerates ("channel": §6's two channels)
DESIGN_METRICS: dict[str, tuple[str, dict[str, tuple[str, ...] | None]]] = {
    "sift_search_duration_seconds": ("histogram", {"mode": None, "outcome": None}),
    "sift_job_queue_wait_seconds": ("histogram", {"queue": None}),
    "sift_retrieval_duration_seconds": ("histogram", {"backend": None,
                                                      "channel": ("bm25", "knn")}),
    "sift_rerank_duration_seconds": ("histogram", {"model": None, "outcome": None}),
    "sift_rerank_tokens_total": ("counter", {"model": None, "type": (
        "input", "output", "cache_read", "cache_creation")}),
    "sift_rerank_attempts_total": ("counter", {"model": None, "result": (
        "ok", "timeout", "http_5xx", "rate_limited", "connection", "http_4xx", "malformed")}),
    "sift_rerank_outcomes_total": ("counter", {"policy": None, "outcome": (
        "applied", "fallback_no_valid_ranks", "fallback_error", "failed", "skipped")}),
    "sift_rerank_cost_usd_total": ("counter", {"model": None}),
    "sift_jobs_in_flight": ("gauge", {"state": None}),
    "sift_webhook_deliveries_total": ("counter", {"result": None}),
}  # fmt: skip
# the code's closed set of each label the contract enumerates
CLOSED_VALUES = {
    ("sift_retrieval_duration_seconds", "channel"): metrics.RETRIEVAL_CHANNELS,
    ("sift_rerank_tokens_total", "type"): metrics.TOKEN_TYPES,
    ("sift_rerank_attempts_total", "result"): metrics.ATTEMPT_RESULTS,
    ("sift_rerank_outcomes_total", "outcome"): metrics.RERANK_OUTCOME_VALUES,
}


def test_the_readme_names_every_departure_from_the_metric_contract() -> None:
    """Every metric the contract lacks, every label and every label value the code adds to
    one it has, is named in the README's departures (a value or a label in the same bullet
    as its metric); and every contract metric is exported with its type."""
    departures = section("Where Sift extends or departs from the design, and why")
    bullets = [re.sub(r"\s+", " ", b) for b in departures.split("\n- ")]

    def named(metric: str, what: str) -> bool:
        return any(f"`{metric}" in b and f"`{what}`" in b for b in bullets)

    found = [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    types = {m._name + ("_total" if m._type == "counter" else ""): m._type for m in found}
    for name, labels in exported_metrics().items():
        if name not in DESIGN_METRICS:
            family = re.sub(r"^(sift_(task|http))_.*", r"\1_*", name)
            assert f"`{family}`" in departures or f"`{name}`" in departures, name
            continue
        kind, contract = DESIGN_METRICS[name]
        assert types[name] == kind, name
        assert set(contract) <= labels, name
        for label in sorted(labels - set(contract)):
            assert named(name, label), f"{name}: label {label}"
        for label, values in contract.items():
            for value in CLOSED_VALUES.get((name, label), ()):
                assert value in (values or ()) or named(name, value), f"{name}{{{label}={value}}}"
    assert set(DESIGN_METRICS) <= set(exported_metrics())


def test_every_route_the_docs_name_is_served() -> None:
    paths = create_app(Settings(redis_url="redis://127.0.0.1:9/0")).openapi()["paths"]
    served = {(m.upper(), re.sub(r"\{[^}]+\}", "{}", p)) for p, ops in paths.items() for m in ops}
    text = re.sub(r"`\s*\n\s*", "`", read("README.md and docs/").replace("`POST\n/", "`POST /"))
    named = set(re.findall(r"\b(GET|POST|PATCH|DELETE) (/v1/[a-z/{}_]+[a-z}])", text))
    assert len(named) > 10
    for method, path in named:
        assert (method, re.sub(r"\{[^}]+\}", "{}", path)) in served, f"{method} {path}"


# --- files ----------------------------------------------------------------------------------

MADE_BY_THE_USER = {"deploy/.env", "deploy/sift.env"}  # copied from their .example


@pytest.mark.parametrize("document", list(GUIDES))
def test_every_file_and_test_the_docs_name_exists(document: str) -> None:
    text = read(document)
    paths = set(
        re.findall(
            r"`((?:tests|benchmarks|worker|api_gateway|deploy|grafana|scripts|k8s|prometheus)/[\w./-]+)",
            text,
        )
    )
    paths = {p.rstrip(".") for p in paths} - MADE_BY_THE_USER
    assert paths
    missing = [p for p in paths if not (ROOT / p).exists() and not (ROOT / "deploy" / p).exists()]
    assert missing == []
    for module, test in re.findall(r"\b(test_\w+\.py)::(test_\w+)", text):
        found = list((ROOT / "tests").rglob(module))
        assert found, f"{module} is in no tests/ folder"
        assert f"def {test}(" in found[0].read_text(), f"{module}::{test}"
    for module in set(re.findall(r"`(test_\w+\.py)", text)):
        assert list((ROOT / "tests").rglob(module)), module


def test_the_compose_walkthrough_names_the_indexes_the_first_write_makes() -> None:
    """deploy/README.md's walkthrough (tenant ``demo`` of deploy/.env.example, index ``demo``)
    names the template, the concrete index and the alias the Elasticsearch backend makes."""
    from unittest.mock import MagicMock

    from worker.adapters.elasticsearch import ElasticsearchBackend
    from worker.adapters.elasticsearch._layout import concrete_name

    text = read("deploy/README.md")
    said = re.search(
        r"The first write to an index creates it in Elasticsearch:(.+?)\n\n", text, re.S
    )
    assert said, "the walkthrough no longer says what the first write makes"
    backend = ElasticsearchBackend(MagicMock(), prefix="sift-")
    alias = backend.alias("demo", "demo")
    named = set(re.findall(r"`([^`]+)`", said.group(1)))
    assert {"sift-sift", alias, concrete_name(alias, "000001")} <= named, named


def test_the_api_keys_deploy_readme_gives_cover_every_index_sift_reads_and_writes() -> None:
    """deploy/README.md §4's API key (``names: ["sift-*"]``), and the ``names`` it gives for
    an empty prefix (an operator's index ``catalogue`` under each tenant's alias), cover
    every index the backend touches: the tenant's alias and the concrete index it makes,
    and Sift's own floors and settings indexes, which every versioned write (the floor's
    ``GET``) and every search (the settings' ``_mget``) reads. The empty prefix's names left
    out ``sift-floors`` and ``sift-settings``: with them, every write failed ``config_error``
    and every search failed reading its settings."""
    import fnmatch
    import json
    from unittest.mock import MagicMock

    from worker.adapters.elasticsearch import ElasticsearchBackend
    from worker.adapters.elasticsearch._layout import concrete_name

    text = read("deploy/README.md")
    role = re.search(r'"indices": \[\{"names": (\[[^\]]*\])', text)
    empty = re.search(r"with an empty prefix \(the API key above then needs its `names`.*?e\.g\. "
                      r"`(\[[^\]]*\])`", text, re.S)  # fmt: skip
    assert role and empty, "deploy/README.md §4 no longer gives the key's names"
    for prefix, names, index in (
        ("sift-", role.group(1), "docs"),
        ("", empty.group(1), "catalogue"),
    ):
        patterns = json.loads(names)
        backend = ElasticsearchBackend(MagicMock(), prefix=prefix)
        alias = backend.alias(index, "acme")
        touched = [
            alias,
            concrete_name(alias, "000001"),
            backend.floors_index(),
            backend.settings_index,
        ]
        uncovered = [n for n in touched if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        assert not uncovered, f"prefix {prefix!r}: {patterns} leave out {uncovered}"
