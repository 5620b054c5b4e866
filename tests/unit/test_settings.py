"""The settings object as the environment sets it: what an empty variable means, and the
rerank model's ``output_config.effort`` as the worker's bootstrap builds it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kubelet import service_links
from worker.errors import ConfigError
from worker.runtime.bootstrap import build_batch_client, build_reranker
from worker.settings import load_settings


@pytest.mark.parametrize(
    ("variable", "field"),
    [
        ("SIFT_GENERATION_EFFORT", "generation_effort"),  # README: "empty for models without it"
        ("SIFT_VECTOR_MIN_SIMILARITY", "vector_min_similarity"),  # DESIGN: unset by default
        ("SIFT_BROKER_VISIBILITY_TIMEOUT_SECONDS", "broker_visibility_timeout_seconds"),
        ("SIFT_GENERATION_MODEL", "generation_model"),
        ("SIFT_API_KEYS_FILE", "api_keys_file"),
    ],
)
def test_an_optional_settings_empty_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, variable: str, field: str
) -> None:
    monkeypatch.setenv(variable, "")
    assert getattr(load_settings(), field) is None


def test_an_empty_metrics_token_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # unset opens /metrics: a Secret gone missing must not do that silently
    monkeypatch.setenv("SIFT_METRICS_TOKEN", "")
    with pytest.raises(ConfigError, match="SIFT_METRICS_TOKEN"):
        load_settings()


def test_an_empty_required_setting_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIFT_GENERATION_TIMEOUT_SECONDS", "")
    with pytest.raises(ConfigError, match="SIFT_GENERATION_TIMEOUT_SECONDS"):
        load_settings()


@pytest.mark.parametrize("variable", ["SIFT_DATA_DIR", "SIFT_MODEL_CACHE_DIR"])
def test_an_empty_folder_setting_is_refused_not_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str
) -> None:
    """``Path("")`` is ``.``: an empty ``SIFT_DATA_DIR`` (a compose file's unset
    ``${DATA_DIR}``) put the index, and ``sift up``'s Redis AOF, logs, development key and
    lock, in whatever folder the process started in, silently; now it stops start-up naming
    the variable, as any other setting's empty variable does (docs/settings.md)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, "")
    with pytest.raises(ConfigError, match=f"{variable}: is empty"):
        load_settings()
    monkeypatch.setenv(variable, "  ")
    with pytest.raises(ConfigError, match=f"{variable}: is empty"):
        load_settings()


@pytest.mark.parametrize(
    ("model", "effort", "sent"),
    [
        ("claude-haiku-4-5", None, None),  # the README's model, at the default (auto)
        ("claude-sonnet-4-6", None, "low"),
        ("claude-opus-4-7", None, "low"),
        ("claude-haiku-4-5", "", None),
        ("claude-sonnet-4-6", "none", None),
        ("claude-sonnet-4-6", "", None),
        ("claude-future-7", "high", "high"),  # a model newer than the table, a level set
    ],
)
def test_the_effort_the_worker_sends_each_model(
    monkeypatch: pytest.MonkeyPatch, model: str, effort: str | None, sent: str | None
) -> None:
    monkeypatch.setenv("SIFT_GENERATION_MODEL", f"anthropic:{model}")
    monkeypatch.delenv("SIFT_REDIS_URL", raising=False)
    if effort is not None:
        monkeypatch.setenv("SIFT_GENERATION_EFFORT", effort)
    settings = load_settings()
    reranker = build_reranker(settings)
    batches = build_batch_client(settings)  # the economy lane's Message Batches requests
    assert reranker is not None and batches is not None
    assert reranker.effort == sent  # type: ignore[attr-defined]
    assert batches.reranker.effort == sent


@pytest.mark.parametrize(
    ("model", "effort", "why"),
    [
        ("claude-haiku-4-5", "low", "claude-haiku-4-5 takes no effort level"),
        ("claude-sonnet-4-6", "xhigh", "claude-sonnet-4-6 takes low, medium, high or max"),
        ("claude-opus-4-5-20251101", "max", "takes low, medium or high"),
    ],
)
def test_an_effort_level_the_model_is_known_to_refuse_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, model: str, effort: str, why: str
) -> None:
    # it was sent, and the API answered every call with a 400: every rerank failed
    monkeypatch.setenv("SIFT_GENERATION_MODEL", f"anthropic:{model}")
    monkeypatch.setenv("SIFT_GENERATION_EFFORT", effort)
    with pytest.raises(ConfigError, match=rf"SIFT_GENERATION_EFFORT={effort} .*{re.escape(why)}"):
        load_settings()


def test_a_misspelled_variable_is_refused_naming_it_and_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # it was ignored: SIFT_RERANK_ENABLE=true did nothing, silently
    monkeypatch.setenv("SIFT_RERANK_ENABLE", "true")
    with pytest.raises(ConfigError, match=r"SIFT_RERANK_ENABLE is no setting.*SIFT_RERANK_ENABLED"):
        load_settings()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SIFT_IMAGE", "sift:local"),  # compose's image tag
        ("SIFT_REDIS_ADDRESS", "redis:6379"),  # KEDA's, in deploy/k8s's ConfigMap
        ("SIFT_TEST_ELASTICSEARCH_URL", "http://127.0.0.1:9200"),  # the tests'
        # Kubernetes's service links of the Services sift-gateway and sift-worker-metrics
        ("SIFT_GATEWAY_SERVICE_HOST", "10.0.0.7"),
        ("SIFT_GATEWAY_SERVICE_PORT", "8080"),
        ("SIFT_GATEWAY_SERVICE_PORT_HTTP", "8080"),
        ("SIFT_GATEWAY_PORT_8080_TCP", "tcp://10.0.0.7:8080"),
        ("SIFT_GATEWAY_PORT_8080_TCP_ADDR", "10.0.0.7"),
        ("SIFT_WORKER_METRICS_PORT_9808_TCP_PROTO", "tcp"),
        ("SIFT_OTHER_PORT", "tcp://10.0.0.9:80"),  # a Service sift-other's
        ("sift_log_level", "INFO"),  # a setting, in any case
    ],
)
def test_variables_set_on_purpose_that_are_no_setting_are_let_be(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    load_settings()


def test_every_sift_command_stops_on_a_misspelled_variable(tmp_path: Path) -> None:
    """The services and the client commands alike exit 2, a usage error, saying which
    variable, before anything starts (no Redis listens here)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "HOME": str(tmp_path),
        "SIFT_REDIS_URL": "redis://127.0.0.1:9/0",
        "SIFT_RERANK_ENABLE": "true",
    }
    commands = (
        ["gateway"],
        ["worker"],
        ["up"],
        ["search", "tea", "--index", "docs"],
        ["indexes"],
        ["cost"],
        ["status"],
        ["tenant", "purge", "acme", "--yes"],
    )
    for command in commands:
        run = subprocess.run(
            [sys.executable, "-m", "worker.cli", *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = " ".join((run.stdout + run.stderr).split())
        assert run.returncode == 2, (command, output)
        assert "SIFT_RERANK_ENABLE is no setting (did you mean SIFT_RERANK_ENABLED?)" in output


@pytest.mark.parametrize(
    "service",
    # "sift" is the name a chart or a hand-written manifest gives the gateway's Service: its
    # links are SIFT_SERVICE_HOST, SIFT_PORT_80_TCP..., with no word between SIFT_ and the rest
    ["sift", "sift-gateway", "sift-redis", "sift-api-grpc"],
)
def test_the_service_links_of_a_sift_service_are_let_be(
    monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    for name, value in service_links(service, "10.96.0.7", [("http", 80), ("web", 81)]).items():
        monkeypatch.setenv(name, value)
    load_settings()


def test_a_port_setting_given_a_service_link_keeps_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Service sift-gateway gives every pod of its namespace SIFT_GATEWAY_PORT=tcp://...
    (and one named sift-worker-metrics with a cluster IP, SIFT_WORKER_METRICS_PORT): a pod
    whose own variables do not set them (a `sift batch` Job, a manifest without deploy/'s
    ConfigMap) stopped at start-up on "SIFT_GATEWAY_PORT: Input should be a valid integer".
    An address is never a port setting: the default stands; a number still sets it."""
    monkeypatch.setenv("SIFT_GATEWAY_PORT", "tcp://10.96.0.7:80")
    monkeypatch.setenv("SIFT_WORKER_METRICS_PORT", "tcp://[fd00::7]:9808")
    settings = load_settings()
    assert (settings.gateway_port, settings.worker_metrics_port) == (8080, 9808)
    monkeypatch.setenv("SIFT_GATEWAY_PORT", "8081")
    assert load_settings().gateway_port == 8081
    monkeypatch.setenv("SIFT_GATEWAY_PORT", "http://10.96.0.7:80")  # no service link
    with pytest.raises(ConfigError, match="SIFT_GATEWAY_PORT"):
        load_settings()


@pytest.mark.parametrize(
    ("variable", "value", "path"),
    [
        # a price left out: before, "SIFT_PRICES: Field required", not which model's which price
        (
            "SIFT_PRICES",
            '{"claude-haiku-4-5": {"input": 1, "output": 5, "cache_read": 0.1}}',
            "SIFT_PRICES.claude-haiku-4-5.cache_creation: Field required",
        ),
        (
            "SIFT_RATE_LIMITS",
            '{"claude-haiku-4-5": {"rpm": 10, "economy": {"queued": 0}}}',
            "SIFT_RATE_LIMITS.claude-haiku-4-5.economy.queued: Input should be greater than",
        ),
        (
            "SIFT_API_KEYS",
            '[{"key": "k-00000001", "tenant": "a", "webhook_secret": "whsec_QQ=="},'
            ' {"key": "k-00000002", "webhook_secret": "whsec_QQ=="}]',
            "SIFT_API_KEYS.1.tenant: Field required",
        ),
        ("SIFT_FUSION_WEIGHTS", '{"bm25": -1}', "SIFT_FUSION_WEIGHTS.bm25: Input should be"),
    ],
)
def test_a_json_settings_error_names_its_full_path(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, path: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as raised:
        load_settings()
    assert path in str(raised.value)


def test_a_keys_files_error_names_its_full_path(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('[{"key": "k-00000001", "tenant": "a", "webhook_secret": "nope"}]')
    with pytest.raises(ConfigError) as raised:
        load_settings(api_keys_file=keys).all_api_keys()
    said = str(raised.value)
    assert said.startswith(f"SIFT_API_KEYS_FILE ({keys}): entry 0, field webhook_secret: "), said
    assert "String should match pattern" in said and "nope" not in said, said


@pytest.mark.parametrize(
    ("text", "problems"),
    [
        (None, ["No such file or directory"]),  # the file is not there
        ("{not json", ["Invalid JSON"]),
        (
            json.dumps([{"key": "short", "tenant": "a"}, {"key": "k-00000002", "tenant": "a b"}]),
            ["entry 0, field key: ", "entry 0, field webhook_secret: Field required",
             "entry 1, field tenant: ", "entry 1, field webhook_secret: Field required"],
        ),
    ],
    ids=["missing", "not-json", "entries"],
)  # fmt: skip
def test_a_keys_files_error_is_one_line_naming_the_setting_and_the_file_once(
    tmp_path: Path, text: str | None, problems: list[str]
) -> None:
    """Each problem of ``SIFT_API_KEYS_FILE`` is named by its entry and field, never its
    value, on one line that names the setting and the file once: the setting was repeated
    before every field, and a file not there was named twice (the OS error quotes it)."""
    keys = tmp_path / "keys.json"
    if text is not None:
        keys.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_settings(api_keys_file=keys).all_api_keys()
    said = str(raised.value)
    assert said.startswith(f"SIFT_API_KEYS_FILE ({keys}): "), said
    assert said.count("SIFT_API_KEYS_FILE") == 1 and said.count(str(keys)) == 1, said
    assert "\n" not in said and "short" not in said, said  # one line, no value quoted
    for problem in problems:
        assert problem in said, said


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SIFT_REDIS_URL", "127.0.0.1:6379"),  # the scheme left out, as compose files write it
        ("SIFT_REDIS_URL", "http://127.0.0.1:6379"),
        # what redis-py and kombu parse apart: tracebacks in the gateway and the worker (a
        # port), or the gateway on db 0 while the worker exited 0 (a database not a number)
        ("SIFT_REDIS_URL", "redis://127.0.0.1:notaport/0"),
        ("SIFT_REDIS_URL", "redis://127.0.0.1:99999/0"),
        ("SIFT_REDIS_URL", "redis://127.0.0.1:0/0"),
        ("SIFT_REDIS_URL", "redis://127.0.0.1:6379/abc"),
        ("SIFT_REDIS_URL", "redis://127.0.0.1:6379/-1"),
        ("SIFT_REDIS_URL", "redis://127.0.0.1:6379?db=abc"),
        ("SIFT_REDIS_URL", "unix:///run/redis/redis.sock?db=-1"),
        # what redis-py (RedisError at the first command) and kombu (KeyError) refuse alike
        ("SIFT_REDIS_URL", "rediss://redis.internal:6380/0?ssl_cert_reqs=bogus"),
        ("SIFT_REDIS_URL", "rediss://redis.internal:6380/0?ssl_cert_reqs=CERT_REQUIRED"),
        ("SIFT_URL", "127.0.0.1:8080"),
        ("SIFT_URL", "ftp://gateway:8080"),
        ("SIFT_PROMETHEUS_URL", "prometheus:9090"),
        ("SIFT_ELASTICSEARCH_URL", "es:9200"),
        ("SIFT_ELASTICSEARCH_URL", "http://es"),  # the client needs the port
    ],
)
def test_a_url_setting_without_its_scheme_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """A URL the client it is for cannot use is a start-up error naming the variable. Before,
    ``SIFT_REDIS_URL=127.0.0.1:6379`` started a ``sift worker`` whose Celery tried
    ``amqp://guest@127.0.0.1%3A6379:5672`` a hundred times, and the gateway and ``sift status``
    stopped on a traceback; ``SIFT_URL=127.0.0.1:8080`` had ``sift indexes`` say "trying
    again" for two minutes; a bad ``SIFT_ELASTICSEARCH_URL`` was the client's traceback."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"{variable}: .*{re.escape(repr(value))}"):
        load_settings()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SIFT_REDIS_URL", "redis://127.0.0.1:6379/0"),
        ("SIFT_REDIS_URL", "rediss://:secret@redis.internal:6380/1"),
        ("SIFT_REDIS_URL", "unix:///run/redis/redis.sock?db=0"),
        ("SIFT_REDIS_URL", "redis://redis"),  # port 6379, db 0
        ("SIFT_REDIS_URL", "redis://127.0.0.1:6379/"),
        ("SIFT_REDIS_URL", "redis://127.0.0.1:6379?db=2"),
        ("SIFT_REDIS_URL", "rediss://redis:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.crt"),
        ("SIFT_REDIS_URL", "rediss://redis:6380/0?ssl_cert_reqs=none"),
        ("SIFT_URL", "https://sift.example.com/api"),
        ("SIFT_PROMETHEUS_URL", "http://[::1]:9090"),
        ("SIFT_ELASTICSEARCH_URL", "https://elastic:pw@es.internal:9200"),
    ],
)
def test_the_url_settings_take_what_their_clients_take(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    assert getattr(load_settings(), variable.removeprefix("SIFT_").lower()) == value


def test_a_redis_url_with_a_password_is_refused_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIFT_REDIS_URL", "redis://:s3cret@127.0.0.1:99999/0")
    with pytest.raises(ConfigError, match=r"SIFT_REDIS_URL: .*port") as raised:
        load_settings()
    assert "s3cret" not in str(raised.value)


def test_every_sift_command_stops_on_a_redis_url_without_its_scheme(tmp_path: Path) -> None:
    """The gateway, the worker, ``sift status`` and a CLI read each exit with one line naming
    the variable, at once (the worker retried an AMQP broker it made up; the others printed a
    traceback, or retried for two minutes)."""
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "HOME": str(tmp_path),
        "SIFT_REDIS_URL": "127.0.0.1:9",
        "SIFT_URL": "127.0.0.1:9",
    }
    for command in (["gateway"], ["worker"], ["status"], ["indexes"]):
        run = subprocess.run(
            [sys.executable, "-m", "worker.cli", *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        output = " ".join((run.stdout + run.stderr).split())
        assert run.returncode == 2, (command, output)
        assert "Traceback" not in output and "trying again" not in output, (command, output)
        assert "SIFT_REDIS_URL: " in output and "'127.0.0.1:9'" in output, (command, output)


# every float setting, with a value past its bound: a day for a per-request or per-job
# timeout and for the re-drive's and economy poll's waits, longer where the setting is meant
# to be long (the economy deadline), a factor for the webhook retry scale
FLOAT_SETTINGS = {
    "SIFT_ELASTICSEARCH_REQUEST_TIMEOUT": "86401",
    "SIFT_GENERATION_TIMEOUT_SECONDS": "86401",
    "SIFT_VECTOR_MIN_SIMILARITY": "1.5",
    "SIFT_SEARCH_DEADLINE_SECONDS": "86401",
    "SIFT_WEBHOOK_CONNECT_TIMEOUT_SECONDS": "86401",
    "SIFT_WEBHOOK_READ_TIMEOUT_SECONDS": "86401",
    "SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS": "86401",
    "SIFT_WEBHOOK_RETRY_SCALE": "11",
    "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1e20",
    "SIFT_REDRIVE_INTERVAL_SECONDS": "86401",
    "SIFT_REDRIVE_STALL_SECONDS": "86401",
    "SIFT_WORKER_HEARTBEAT_SECONDS": "61",
    "SIFT_WORKER_DEAD_AFTER_SECONDS": "601",
    "SIFT_WORKER_ORPHAN_DELIVERY_SECONDS": "86401",
    "SIFT_ECONOMY_DEADLINE_SECONDS": "2592001",
    "SIFT_ECONOMY_POLL_SECONDS": "86401",
    "SIFT_ECONOMY_POLL_MAX_SECONDS": "86401",
    "SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS": "86401",
}


def test_every_float_setting_is_listed_here() -> None:
    from worker.settings import Settings

    floats = {
        f"SIFT_{name.upper()}"
        for name, field in Settings.model_fields.items()
        if field.annotation in (float, float | None)
    }
    assert floats == set(FLOAT_SETTINGS)


@pytest.mark.parametrize("variable", sorted(FLOAT_SETTINGS))
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_no_float_setting_takes_infinity_or_nan(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    # inf crashed `sift worker` (an int() of the visibility timeout), made /readyz a 500
    # (a socket timeout), turned the re-drive off silently
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=rf"{variable}:"):
        load_settings()


@pytest.mark.parametrize(("variable", "value"), sorted(FLOAT_SETTINGS.items()))
def test_each_float_setting_has_a_finite_bound(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    # SIFT_WORKER_SOFT_SHUTDOWN_SECONDS=1e20 killed the stop-deadline thread (OverflowError)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=rf"{variable}: .*less than or equal"):
        load_settings()


# every whole-number setting: each has a finite bound, as the float ones do (above); a
# value past it stops start-up naming the variable. Unbounded, SIFT_MAX_BODY_BYTES=1e20 let
# the gateway take a body of any size into memory, SIFT_ELASTICSEARCH_GC_DELETES_SECONDS
# past Elasticsearch's time range had every index it made refused, and a huge
# SIFT_BROKER_VISIBILITY_TIMEOUT_SECONDS never put a message back (a 1.2e21 s window)
HUGE = "99999999999999999999"


def _int_settings() -> set[str]:
    from worker.settings import Settings

    return {
        f"SIFT_{name.upper()}"
        for name, field in Settings.model_fields.items()
        if field.annotation in (int, int | None)
    }


@pytest.mark.parametrize("variable", sorted(_int_settings()))
def test_each_whole_number_setting_has_a_finite_bound(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, HUGE)
    with pytest.raises(ConfigError, match=rf"{variable}: .*less than or equal") as raised:
        load_settings()
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("field", ["rpm", "itpm", "otpm"])
def test_a_rate_limit_has_a_finite_bound(monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    monkeypatch.setenv("SIFT_RATE_LIMITS", json.dumps({"claude-haiku-4-5": {field: int(HUGE)}}))
    with pytest.raises(ConfigError, match=rf"SIFT_RATE_LIMITS\.claude-haiku-4-5\.{field}: "):
        load_settings()
    economy = {"claude-haiku-4-5": {"economy": {"queued": int(HUGE)}}}
    monkeypatch.setenv("SIFT_RATE_LIMITS", json.dumps(economy))
    with pytest.raises(ConfigError, match=r"SIFT_RATE_LIMITS\.claude-haiku-4-5\.economy\.queued"):
        load_settings()


def test_a_long_generation_timeout_still_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # harmless: each attempt gets the least of it and what is left of the search's deadline
    monkeypatch.setenv("SIFT_GENERATION_TIMEOUT_SECONDS", "86400")
    assert load_settings().generation_timeout_seconds == 86400


def test_a_price_is_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "SIFT_PRICES",
        '{"claude-haiku-4-5": {"input": 1e400, "output": 1, "cache_read": 1, "cache_creation": 1}}',
    )
    with pytest.raises(ConfigError, match=r"SIFT_PRICES\.claude-haiku-4-5\.input"):
        load_settings()


@pytest.mark.parametrize("key", [" k-00000001", "k-00000001\n", "k-00000001 ", "\tk-00000001"])
def test_a_key_with_whitespace_at_an_end_is_refused_naming_its_entry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: str
) -> None:
    """HTTP strips the Authorization header's whitespace, so such a key, taken, could never
    authenticate: its tenant was locked out with no word of why."""
    entries = [
        {"key": "k-00000002", "tenant": "a", "webhook_secret": "whsec_QQ=="},
        {"key": key, "tenant": "b", "webhook_secret": "whsec_QQ=="},
    ]
    monkeypatch.setenv("SIFT_API_KEYS", json.dumps(entries))
    with pytest.raises(ConfigError, match=r"SIFT_API_KEYS\.1\.key: .*whitespace") as raised:
        load_settings()
    assert "k-00000001" not in str(raised.value)
    monkeypatch.delenv("SIFT_API_KEYS")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(entries))
    with pytest.raises(ConfigError, match=r"entry 1, field key: .*whitespace") as raised:
        load_settings(api_keys_file=keys).all_api_keys()
    assert "k-00000001" not in str(raised.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SIFT_GENERATION_THINKING_TOKENS", "48001"), ("SIFT_GENERATION_TOKENS_PER_POSITION", "65")],
)
def test_a_rerank_allowance_past_what_a_model_takes_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """``max_tokens`` past the model's maximum output is a 400 at every rerank."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=rf"{variable}: .*less than or equal"):
        load_settings()


def test_the_largest_rerank_allowance_fits_every_current_models_output() -> None:
    """At the bounds, and a search's largest limit, ``max_tokens`` stays within 64K, the least
    maximum output of Anthropic's current models (Claude Haiku 4.5's, and the 4.5 family's)."""
    from worker.constants import MAX_LIMIT
    from worker.core.policy import build_prompt
    from worker.settings import Settings

    def bound(name: str) -> int:
        (le,) = [m.le for m in Settings.model_fields[name].metadata if hasattr(m, "le")]
        return int(le)

    prompt = build_prompt(
        "q",
        [("", "text")] * MAX_LIMIT,
        k=MAX_LIMIT,
        max_chars=1200,
        thinking_tokens=bound("generation_thinking_tokens"),
        tokens_per_position=bound("generation_tokens_per_position"),
    )
    assert prompt.max_tokens <= 64_000


ELASTICSEARCH_FIELDS = [
    f"SIFT_ELASTICSEARCH_{name}_FIELD"
    for name in ("ID", "TEXT", "TITLE", "VECTOR", "TENANT", "REVISION", "METADATA", "MODEL",
                 "METADATA_TERMS", "WRITE_VERSION")
]  # fmt: skip


@pytest.mark.parametrize("variable", ELASTICSEARCH_FIELDS)
def test_a_blank_elasticsearch_field_name_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """``" "`` passed ``min_length=1`` (and an optional field's ``""``, none, is not it): a
    mapping of a field named by spaces."""
    monkeypatch.setenv(variable, "  ")
    with pytest.raises(ConfigError, match=rf"{variable}: .*blank"):
        load_settings()


def test_the_elasticsearch_field_settings_are_all_listed_here() -> None:
    from worker.settings import Settings

    names = {
        f"SIFT_{name.upper()}"
        for name in Settings.model_fields
        if name.startswith("elasticsearch_") and name.endswith("_field")
    }
    assert names == set(ELASTICSEARCH_FIELDS)


@pytest.mark.parametrize("value", ["", " "])
def test_empty_fusion_weights_are_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Not an unset setting (its default is a value, not unset): a compose file's unset
    ``${FUSION_WEIGHTS}`` was taken as the defaults, silently."""
    monkeypatch.setenv("SIFT_FUSION_WEIGHTS", value)
    with pytest.raises(ConfigError, match=r"SIFT_FUSION_WEIGHTS: .*empty"):
        load_settings()
