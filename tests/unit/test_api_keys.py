"""API key entries: the key itself or only its SHA-256 digest, exactly one of the two."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from api_gateway.app import create_app
from api_gateway.auth import KeyRing
from worker.errors import ConfigError
from worker.settings import ApiKey, load_settings

SECRET = "whsec_YWNtZS1zZWNyZXQtMDEyMzQ1Njc4OQ=="
KEY = "acme-key-0001"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()


def test_a_digest_entry_authenticates_the_key_it_was_made_from() -> None:
    ring = KeyRing(
        [
            ApiKey(key_sha256=DIGEST, tenant="acme", webhook_secret=SECRET),
            ApiKey(key="globex-key-0001", tenant="globex", webhook_secret=SECRET),
        ]
    )
    assert ring.tenant_for(KEY) == "acme"
    assert ring.tenant_for(DIGEST) is None  # the digest itself is not a key
    assert ring.tenant_for("globex-key-0001") == "globex"


def test_an_upper_case_digest_is_the_same_digest() -> None:
    entry = ApiKey(key_sha256=DIGEST.upper(), tenant="acme", webhook_secret=SECRET)
    assert KeyRing([entry]).tenant_for(KEY) == "acme"


@pytest.mark.parametrize(
    ("fields", "given"),
    [({"key": KEY, "key_sha256": DIGEST}, "both"), ({}, "neither")],
)
def test_exactly_one_of_key_and_key_sha256(fields: dict[str, str], given: str) -> None:
    with pytest.raises(ValidationError) as raised:
        ApiKey(tenant="acme", webhook_secret=SECRET, **fields)
    message = str(raised.value)
    assert "key, key_sha256: give exactly one" in message and given in message


def test_a_digest_must_be_64_hex_digits() -> None:
    with pytest.raises(ValidationError) as raised:
        ApiKey(key_sha256=DIGEST[:-1], tenant="acme", webhook_secret=SECRET)
    assert "key_sha256" in str(raised.value)


def test_a_keys_file_may_hold_digests_only(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps([{"key_sha256": DIGEST, "tenant": "acme", "webhook_secret": SECRET}])
    )
    (entry,) = load_settings(api_keys_file=path).all_api_keys()
    assert entry.key is None and entry.digest() == hashlib.sha256(KEY.encode()).digest()


def test_a_bad_entry_is_refused_naming_the_variable_and_the_fields(tmp_path: Path) -> None:
    both = [{"key": KEY, "key_sha256": DIGEST, "tenant": "acme", "webhook_secret": SECRET}]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(both))
    with pytest.raises(
        ConfigError, match=r"SIFT_API_KEYS_FILE .*: entry 0: .*key, key_sha256"
    ) as raised:
        load_settings(api_keys_file=path).all_api_keys()
    assert KEY not in str(raised.value) and SECRET not in str(raised.value)  # not quoted
    with pytest.raises(ConfigError, match=r"SIFT_API_KEYS\.0: .*key, key_sha256"):
        load_settings(api_keys=json.dumps(both))


@pytest.mark.parametrize("globex", [{"key": KEY}, {"key_sha256": DIGEST.upper()}])
def test_one_key_for_two_tenants_is_refused_at_start_up(globex: dict[str, str]) -> None:
    """Before, the entry listed last won: acme's key served globex's data, silently."""
    keys = [
        {"key": KEY, "tenant": "acme", "webhook_secret": SECRET},
        {**globex, "tenant": "globex", "webhook_secret": SECRET},
    ]
    settings = load_settings(api_keys=keys)
    with pytest.raises(ConfigError, match="one key is given for tenants 'acme' and 'globex'"):
        create_app(settings)


def test_one_key_listed_twice_for_one_tenant_is_taken() -> None:
    entry = ApiKey(key=KEY, tenant="acme", webhook_secret=SECRET)
    digest = ApiKey(key_sha256=DIGEST, tenant="acme", webhook_secret=SECRET)
    assert KeyRing([entry, digest]).tenant_for(KEY) == "acme"


@pytest.mark.parametrize("field", ["webhook_secret", "webhook_secret_previous"])
@pytest.mark.parametrize("secret", ["whsec_YWNtZ", "whsec_===="])
def test_a_webhook_secret_no_signature_can_be_made_with_is_refused(field: str, secret: str) -> None:
    """The pattern (``whsec_`` and base64 characters) took ``whsec_YWNtZ`` (5 characters: no
    base64) and ``whsec_====`` (no key at all), with which the Standard Webhooks library
    makes no signature: every webhook of the tenant raised at its signing (binascii.Error,
    EmptyWebhookSecretError), out of the delivery, never sent nor settled. Refused at
    start-up, naming the entry's field, quoting no secret."""
    entry = {"key": KEY, "tenant": "acme", "webhook_secret": SECRET, field: secret}
    with pytest.raises(ConfigError, match=rf"SIFT_API_KEYS\.0\.{field}: ") as raised:
        load_settings(api_keys=[entry])
    assert secret not in str(raised.value)


def test_the_published_placeholder_secret_is_refused_at_start_up() -> None:
    """deploy/.env.example and the k8s Secret ship ``whsec_Q0hB...``: base64 of
    ``CHANGE-ME-webhook-secret``, a secret published with Sift. Left in place, every webhook
    was signed with it, and anyone could forge one the receivers would accept."""
    example = (Path(__file__).parents[2] / "deploy" / ".env.example").read_text()
    line = next(x for x in example.splitlines() if x.startswith("SIFT_API_KEYS="))
    entries = json.loads(line.removeprefix("SIFT_API_KEYS="))
    with pytest.raises(ConfigError, match=r"SIFT_API_KEYS\.0\.webhook_secret: .*placeholder"):
        load_settings(api_keys=entries)


OTHER_SECRET = "whsec_b3RoZXItc2VjcmV0LTAxMjM0NTY3ODk="


@pytest.mark.parametrize(
    "second",
    [
        {"webhook_secret": OTHER_SECRET},
        {"webhook_secret": SECRET, "webhook_secret_previous": OTHER_SECRET},
    ],
)
def test_two_webhook_secrets_for_one_tenant_are_refused_at_start_up(
    second: dict[str, str],
) -> None:
    """A tenant's webhooks are signed with its secret (one per tenant, DESIGN.md §9), which
    the worker took from the tenant's first entry: a second entry giving another secret (a
    second key made with a fresh secret, or a rotation applied to one entry of two) was
    silently never used, and a receiver holding it refused every webhook. Refused at the
    start-up of the gateway and of the workers (only the gateway's before: a worker given
    the file started and signed with the first entry's secret), naming the tenant and the
    entries, quoting no secret."""
    keys = [
        {"key": KEY, "tenant": "acme", "webhook_secret": SECRET},
        {"key": "globex-key-0001", "tenant": "globex", "webhook_secret": OTHER_SECRET},
        {"key": "acme-key-0002", "tenant": "acme", **second},
    ]
    settings = load_settings(api_keys=keys)
    refused = r"tenant 'acme'.* entries 0 and 2"
    with pytest.raises(ConfigError, match=refused) as raised:
        create_app(settings)
    assert SECRET not in str(raised.value) and OTHER_SECRET not in str(raised.value)
    with pytest.raises(ConfigError, match=refused):  # the keys a worker signs with
        settings.all_api_keys()


def test_a_tenant_s_secrets_are_checked_across_the_variable_and_the_file(
    tmp_path: Path,
) -> None:
    """The entries of ``SIFT_API_KEYS`` and of ``SIFT_API_KEYS_FILE`` are one list: a tenant
    keyed in both is given one secret, counted from the variable's entries to the file's."""
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps([{"key": "acme-key-0002", "tenant": "acme", "webhook_secret": OTHER_SECRET}])
    )
    settings = load_settings(
        api_keys=[{"key": KEY, "tenant": "acme", "webhook_secret": SECRET}], api_keys_file=path
    )
    with pytest.raises(ConfigError, match=r"tenant 'acme'.* entries 0 and 1"):
        settings.all_api_keys()
    path.write_text(
        json.dumps([{"key": "acme-key-0002", "tenant": "acme", "webhook_secret": SECRET}])
    )
    assert [k.key for k in settings.all_api_keys()] == [KEY, "acme-key-0002"]


def test_one_tenant_s_keys_with_one_webhook_secret_are_taken() -> None:
    entries = [
        ApiKey(key=KEY, tenant="acme", webhook_secret=SECRET),
        ApiKey(key="acme-key-0002", tenant="acme", webhook_secret=SECRET),
    ]
    assert KeyRing(entries).tenant_for("acme-key-0002") == "acme"


def test_a_metrics_token_set_with_a_trailing_newline_is_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Kubernetes Secret made from a file (``kubectl create secret --from-file``) ends the
    variable with the file's newline. The presented Bearer token is read stripped, so a
    configured token kept with its newline could never be presented: every scrape a 401."""
    from starlette.requests import Request

    from api_gateway.auth import require_metrics_token

    token = "metrics-token-0123456789abcdef"
    monkeypatch.setenv("SIFT_METRICS_TOKEN", token + "\n")
    settings = load_settings()
    assert settings.metrics_token == token
    header = (b"authorization", f"Bearer {token}".encode())
    require_metrics_token(Request({"type": "http", "headers": [header]}), settings.metrics_token)
