"""A gateway with ``SIFT_METRICS_TOKEN``, scraped by a real Prometheus as deploy/prometheus's
``prometheus.yml`` says to: ``authorization: credentials_file`` on the gateway job.

The job given the token's file (written with a trailing newline, as an editor or ``echo``
leaves it) is up and stores the gateway's fleet-wide figures; a job without it is down (401),
which ``SiftGatewayScrapeFailing`` alerts on. A real redis-server, a real gateway under uvicorn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.prometheus_support import requires_prometheus, run_prometheus, wait_until
from tests.services import gateway, redis_server

pytestmark = [
    pytest.mark.integration,
    requires_prometheus(),
]

KEY = {"key": "acme-key-0001", "tenant": "acme", "webhook_secret": "whsec_YWNtZQ=="}
TOKEN = "metrics-token-0123456789abcdef"


def test_prometheus_reads_a_guarded_gateway_with_the_token_and_only_with_it(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "sift-metrics-token"
    token_file.write_text(TOKEN + "\n")
    with redis_server(tmp_path / "redis") as redis_url:
        env = {
            "SIFT_API_KEYS": json.dumps([KEY]),
            "SIFT_REDIS_URL": f"{redis_url}/0",
            "SIFT_DATA_DIR": str(tmp_path / "data"),
            "SIFT_METRICS_TOKEN": TOKEN,
        }
        with gateway(tmp_path, env, "gateway") as url:
            target = [url.removeprefix("http://")]
            with run_prometheus(
                tmp_path / "prometheus",
                {"with-token": target, "without-token": target},
                job_options={
                    "with-token": {"authorization": {"credentials_file": str(token_file)}}
                },
            ) as prometheus:
                wait_until(
                    lambda: len(prometheus.values("up", by="job")) == 2,
                    "both jobs scraped once",
                )
                wait_until(
                    lambda: (
                        prometheus.values('sift_jobs_in_flight{state="queued"}', by="job")
                        == {"with-token": 0.0}
                    ),
                    "the queued count stored from the job with the token",
                )
                assert prometheus.values("up", by="job") == {
                    "with-token": 1.0,
                    "without-token": 0.0,
                }
