"""The SSRF guard refuses every non-public address a webhook URL can reach, in every spelling."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from worker.errors import InvalidRequest
from worker.webhooks.urlguard import check_webhook_url, refusal_reason

REAL_GETADDRINFO = socket.getaddrinfo


def fake_dns(answers: dict[str, list[str]]) -> Any:
    """getaddrinfo that answers the given names and defers the rest (literals) to the real one.

    There is no DNS in the test sandbox, so this is the one boundary we fake.
    """

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host in answers:
            out = []
            for address in answers[host]:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                sockaddr: tuple[Any, ...] = (
                    (address, port, 0, 0) if family == socket.AF_INET6 else (address, port)
                )
                out.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
            return out
        return REAL_GETADDRINFO(host, port, *args, **kwargs)

    return getaddrinfo


def refused(url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        check_webhook_url(url, allow_private=False)
    assert info.value.field == "webhook_url"
    return info.value


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1/hook", "loopback"),
        ("http://127.1.2.3:8080/hook", "loopback"),
        ("http://localhost/hook", "loopback"),
        ("http://[::1]/hook", "loopback"),
        ("http://10.1.2.3/hook", "private"),
        ("http://172.16.0.1/hook", "private"),
        ("http://172.31.255.254/hook", "private"),
        ("http://192.168.1.1/hook", "private"),
        ("http://[fd12:3456::1]/hook", "private"),
        ("http://169.254.1.1/hook", "link-local"),
        ("http://[fe80::1]/hook", "link-local"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[fd00:ec2::254]/", "metadata"),
        ("http://100.100.100.200/", "metadata"),
        ("http://100.64.0.1/hook", "carrier-grade NAT"),
        ("http://0.0.0.0/hook", "unspecified"),
        ("http://[::]/hook", "unspecified"),
        ("http://224.0.0.1/hook", "multicast"),
        ("http://240.0.0.1/hook", "reserved"),
        ("http://[::ffff:127.0.0.1]/hook", "embeds 127.0.0.1, 127.0.0.1 is a loopback"),
        ("http://[::ffff:10.0.0.1]/hook", "embeds 10.0.0.1, 10.0.0.1 is a private"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        ("http://[::127.0.0.1]/hook", "loopback"),
        ("http://[2002:7f00:1::]/hook", "loopback"),  # 6to4 around 127.0.0.1
        ("http://[64:ff9b::a00:1]/hook", "private"),  # NAT64 around 10.0.0.1
        ("http://2130706433/hook", "127.0.0.1 is a loopback"),  # decimal
        ("http://0x7f.1/hook", "127.0.0.1 is a loopback"),  # hex, short form
        ("http://0177.0.0.1/hook", "127.0.0.1 is a loopback"),  # octal
        ("https://192.0.2.10/hook", "non-public address"),  # documentation range
        ("http://[2001:db8::1]/hook", "non-public address"),  # documentation range
    ],
)
def test_non_public_addresses_are_refused(url: str, why: str) -> None:
    error = refused(url)
    assert why in error.message
    assert error.message.startswith("webhook_url: ")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.com/hook", "scheme must be http or https, not ftp"),
        ("file:///etc/passwd", "scheme must be http or https, not file"),
        ("gopher://93.184.216.34/", "not gopher"),
        ("//93.184.216.34/hook", "not none"),
        ("http:///hook", "no host"),
        ("http://", "no host"),
        ("", "empty"),
        ("http://93.184.216.34:99999/", "malformed"),
        ("http://93.184.216.34/ hook", "whitespace"),
    ],
)
def test_bad_forms_are_refused_even_when_private_is_allowed(url: str, why: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_webhook_url(url, allow_private=True)
    assert info.value.field == "webhook_url"
    assert why in info.value.message


def test_a_name_resolving_to_a_private_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"evil.example": ["10.0.0.5"]}))
    error = refused("https://evil.example/hook")
    assert "'evil.example' resolves to a non-public address: 10.0.0.5 is a private" in error.message


def test_a_name_with_one_private_answer_among_public_ones_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {"mixed.example": ["93.184.216.34", "2606:2800:220:1::1", "192.168.0.7"]}
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns(answers))
    assert "192.168.0.7 is a private" in refused("https://mixed.example/").message


def test_a_name_resolving_to_a_mapped_loopback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"v6.example": ["::ffff:127.0.0.1"]}))
    assert "loopback" in refused("https://v6.example/").message


def test_a_public_name_passes_and_returns_every_address(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"hooks.example": ["93.184.216.34", "2606:2800:220:1::1", "93.184.216.34"]}
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns(answers))
    addresses = check_webhook_url("https://hooks.example/sift?x=1", allow_private=False)
    assert addresses == [
        ipaddress.ip_address("93.184.216.34"),
        ipaddress.ip_address("2606:2800:220:1::1"),
    ]


def test_a_name_that_does_not_resolve_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def nowhere(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nowhere)
    assert "does not resolve" in refused("https://nowhere.example/").message


@pytest.mark.parametrize(
    "url",
    ["http://93.184.216.34/hook", "https://93.184.216.34:8443/a?b=c", "https://[2606:4700::1111]/"],
)
def test_public_literals_pass(url: str) -> None:
    assert check_webhook_url(url, allow_private=False)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9000/hook", "http://localhost/hook", "http://10.0.0.1/", "http://[::1]/"],
)
def test_allow_private_lifts_the_address_rule(url: str) -> None:
    addresses = check_webhook_url(url, allow_private=True)
    assert addresses and all(refusal_reason(a) is not None for a in addresses)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9000/hook", "http://10.1.2.3/hook", "http://[::1]/hook"]
)
def test_a_local_refusal_names_the_setting_that_allows_it(url: str) -> None:
    message = refused(url).message
    assert "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS=true" in message
    assert "local development" in message


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://2852039166/",
        "http://[fd00:ec2::254]/",
        # embedded in IPv6: the hint was given, the outer address alone looked at
        "http://[::ffff:169.254.169.254]/",
        "http://[64:ff9b::169.254.169.254]/",
        "http://[2002:a9fe:a9fe::1]/",
        "http://[::169.254.169.254]/",
        "http://[::ffff:168.63.129.16]/",
        "http://[::ffff:100.100.100.200]/",
    ],
)
def test_a_metadata_refusal_points_at_no_setting(url: str) -> None:
    message = refused(url).message
    assert "cloud metadata address" in message
    assert "SIFT_WEBHOOK" not in message


def test_a_name_with_a_metadata_answer_among_private_ones_points_at_no_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {"mixed.example": ["10.0.0.1", "::ffff:169.254.169.254"]}
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns(answers))
    message = refused("http://mixed.example/").message
    assert "cloud metadata address" in message and "SIFT_WEBHOOK" not in message


def test_a_mapped_address_of_no_metadata_endpoint_names_the_setting() -> None:
    assert (
        "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS=true" in refused("http://[::ffff:10.0.0.1]/").message
    )
