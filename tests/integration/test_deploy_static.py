"""Static checks of deploy/: no Docker engine or cluster here, so the files are validated.

* the compose file against the Compose Specification's JSON schema (tests/schemas/);
* the Kubernetes manifests, rendered with ``kubectl kustomize`` where kubectl is installed
  (else read from the kustomizations), against the schemas ``kubernetes-validate`` ships;
* the Prometheus configuration with ``promtool check config``;
* the wiring between them: ports, queue names, mounts, probes, placeholders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.kubelet import service_links
from worker.constants import (
    ALL_QUEUES,
    PROMETHEUS_JOB_GATEWAY,
    PROMETHEUS_JOB_WORKER,
    kombu_queue_keys,
)
from worker.errors import ConfigError
from worker.processes.stack import free_port, redis_service
from worker.processes.workers import stop_deadline, supervisor_stop_deadline
from worker.queue.config import TASK_ROUTES, celery_config
from worker.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = ROOT / "tests" / "schemas"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
KUBERNETES_VERSION = "1.33.0"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


# --- docker compose ----------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: e.json_path
    )
    assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_compose_file_passes_docker_compose_config_where_installed() -> None:
    """The real ``docker compose config`` (interpolation, schema, semantics), when present."""
    if shutil.which("docker-compose"):
        command = ["docker-compose"]
    elif shutil.which("docker") and _succeeds(["docker", "compose", "version"]):
        command = ["docker", "compose"]
    else:
        pytest.skip("no docker compose v2 binary here; the JSON schema check above still ran")
    env_file = DEPLOY / ".env.example"
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), "--env-file", str(env_file), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_every_redis_the_docs_run_keeps_an_aof_fsynced_every_second(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """docs/reliability.md's restart guarantees assume Redis with its AOF fsynced every
    second and nothing evicted: ``sift up``'s, the compose file's and docs/queue.md's stack by
    hand (which had ``--appendonly no``)."""
    recipe = (ROOT / "docs" / "queue.md").read_text(encoding="utf-8")
    by_hand = re.search(r"^.*redis-server (?:.*\\\n)*.*", recipe, re.MULTILINE)
    assert by_hand is not None
    service, _ = redis_service(tmp_path, appendonly=True)  # what `sift up` runs
    runs = {
        "docs/queue.md": by_hand.group(0).replace("\\\n", " "),
        "compose": " ".join(compose["services"]["redis"]["command"]),
        "sift up": " ".join(service.command),
    }
    for where, command in runs.items():
        for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
            assert flag in " ".join(command.split()), (where, flag, command)
        # and a limit: without one, noeviction never refuses a write (Redis's maxmemory 0 is
        # none), and a Redis holding every result grows until the host's OOM killer stops it
        limit = re.search(r"--maxmemory (\S+)", " ".join(command.split()))
        assert limit is not None and limit.group(1) not in ("0", "0b"), (where, command)


def test_compose_stack_has_every_piece_wired(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"elasticsearch", "redis", "gateway", "worker", "prometheus", "grafana"}

    es = services["elasticsearch"]
    assert es["image"].startswith("docker.elastic.co/elasticsearch/elasticsearch:")
    assert re.search(r":\$\{ES_VERSION:-9\.\d+\.\d+\}$", es["image"])
    assert es["environment"]["xpack.security.enabled"] == "true"
    assert "ELASTIC_PASSWORD" in es["environment"]
    assert "_cluster/health" in " ".join(es["healthcheck"]["test"])

    redis = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis and "--maxmemory-policy noeviction" in redis

    for name in ("gateway", "worker"):
        service = services[name]
        env = service["environment"]
        assert env["SIFT_SEARCH_BACKEND"] == "elasticsearch"
        assert env["SIFT_ELASTICSEARCH_URL"].startswith("http://elastic:${ELASTIC_PASSWORD")
        assert env["SIFT_REDIS_URL"] == "redis://redis:6379/0"
        assert service["command"] == [name]
        assert service["depends_on"]["elasticsearch"]["condition"] == "service_healthy"
        assert service["image"] == "${SIFT_IMAGE:-sift:local}"
    # one service builds the image the other runs: two building one tag made two Bake
    # targets of it, and a first `docker compose up --build` could fail on the second
    assert services["gateway"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert "build" not in services["worker"]
    # every published port on the host's loopback: the gateway's /metrics has no token here
    for service in services.values():
        assert all(str(p).startswith("127.0.0.1:") for p in service.get("ports", [])), service
    assert "127.0.0.1:8080:8080" in services["gateway"]["ports"]
    assert "/healthz" in " ".join(services["gateway"]["healthcheck"]["test"])
    worker = services["worker"]
    assert "ports" not in worker and "container_name" not in worker  # so --scale works

    prometheus = services["prometheus"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in prometheus["volumes"]
    grafana = services["grafana"]["volumes"]
    assert "../grafana:/var/lib/grafana/dashboards/sift:ro" in grafana
    assert (
        "../grafana/provisioning/datasources.yml:/etc/grafana/provisioning/datasources/sift.yml:ro"
        in grafana
    )


def test_the_docs_say_where_the_compose_ports_listen(compose: dict[str, Any]) -> None:
    """Every port the compose file publishes is on the host's loopback (the gateway's since
    e2532a0: its /metrics has no token there), and deploy/README.md and sift.env.example say
    so, with how to publish the API wider. Both said the gateway's port was published on all
    interfaces, so an operator relied on reaching it, or feared /metrics open, wrongly."""
    ports = [str(p) for s in compose["services"].values() for p in s.get("ports", [])]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports), ports
    readme = " ".join((DEPLOY / "README.md").read_text().split())
    example = " ".join((DEPLOY / "sift.env.example").read_text().replace("#", " ").split())
    for text in (readme, example):
        assert "all interfaces" not in text and "8080, published" not in text
    assert "the gateway's 8080 included, listens on `127.0.0.1` only" in readme
    assert "TLS proxy" in readme and "SIFT_METRICS_TOKEN" in readme
    assert "8080 on 127.0.0.1 only" in example


def test_every_compose_service_rotates_its_logs(compose: dict[str, Any]) -> None:
    """Docker's default json-file driver keeps a container's whole output: a worker logs a
    few lines a search (about 600 bytes), some 10 GB a day at 200 searches/s, until the
    disk is full. Each service's log is capped and rotated."""
    for name, service in compose["services"].items():
        logging = service.get("logging", {})
        options = logging.get("options", {})
        assert logging.get("driver") == "json-file" and options.get("max-size"), name
        assert int(options.get("max-file", "1")) >= 2, name


def test_the_gateway_outlives_its_longest_wait_when_stopped(compose: dict[str, Any]) -> None:
    """A request may wait 30 s (``?wait=``, MAX_WAIT_SECONDS); stopped with less grace
    (Docker's 10 s, the pod's 30 s with no preStop) the gateway was killed under it."""
    from worker.constants import MAX_WAIT_SECONDS

    grace = compose["services"]["gateway"]["stop_grace_period"]
    assert int(grace.removesuffix("s")) >= MAX_WAIT_SECONDS + 10, grace
    pod = yaml.safe_load((K8S / "base" / "gateway-deployment.yaml").read_text())["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= MAX_WAIT_SECONDS + int(pre_stop[-1]) + 5


def test_the_workers_stop_grace_outlasts_their_own_stop_bound(
    compose: dict[str, Any], manifests: tuple[str, list[dict[str, Any]]]
) -> None:
    """A stopped worker gives its running tasks until its stop deadline, then exits, and its
    supervisor SIGKILLs a process still there a margin later (supervisor_stop_deadline). A
    grace shorter than that has the container killed first, its processes' lines unsaid.
    deploy/README.md said a worker had the whole grace "to finish a running search": it
    gives one its stop deadline (25 s), and says so now, with the bound."""
    settings = load_settings()
    bound = supervisor_stop_deadline(settings)
    worker = compose["services"]["worker"]
    assert "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS" not in worker["environment"]
    assert int(str(worker["stop_grace_period"]).removesuffix("s")) > bound
    pod = by_kind(manifests[1])["Deployment", "sift-worker"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > bound
    readme = " ".join((DEPLOY / "README.md").read_text().split())
    grace = pod["terminationGracePeriodSeconds"]
    assert f"has {grace} s before it is killed" in readme
    for seconds in (
        stop_deadline(settings, warming_up=False),
        stop_deadline(settings, warming_up=True),
        bound,
    ):
        assert f"{seconds:g} s" in readme, seconds
    assert "to finish a running search" not in readme


def test_compose_bind_mounts_exist(compose: dict[str, Any]) -> None:
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source


def test_env_example_sets_every_required_variable(compose: dict[str, Any]) -> None:
    required = set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text()))
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert required <= set(example), required - set(example)
    assert all("CHANGE-ME" in example[name] for name in required if "PASSWORD" in name)


def test_grafana_provisioning_points_at_the_mounted_paths() -> None:
    provisioning = ROOT / "grafana" / "provisioning"
    (source,) = load_yaml(provisioning / "datasources.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(provisioning / "dashboards.yml")["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/sift"
    for dashboard in (ROOT / "grafana").glob("*.json"):  # the datasource uid they expect
        assert f'"uid": "{source["uid"]}"' in dashboard.read_text(), dashboard.name


def test_dockerfile_is_multi_stage_non_root_with_the_sift_entrypoint() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, flags=re.MULTILINE)
    assert stages == ["builder", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    assert re.search(r"^USER 10001:10001$", runtime, flags=re.MULTILINE)
    assert 'ENTRYPOINT ["sift"]' in runtime
    assert "pip wheel" in text.split("AS runtime", 1)[0]
    for copied in re.findall(r"^COPY (?!--)(\S+)", text, flags=re.MULTILINE):
        assert (ROOT / copied).exists(), copied


# --- prometheus --------------------------------------------------------------------------


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing = "promtool is not installed (apt-get install prometheus); .ci/run installs it"
        if os.environ.get("CI"):
            pytest.fail(missing)  # in CI a skip here would go unseen
        pytest.skip(missing)
    return promtool


def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(
        [_promtool(), "check", "config", str(PROMETHEUS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_config_with_the_repository_rules(tmp_path: Path) -> None:
    """The same config, its rule_files pointed at deploy/prometheus/rules/, so they are checked."""
    config = load_yaml(PROMETHEUS)
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules" / "*.yml")]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [_promtool(), "check", "config", str(local)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_local_config_for_sift_up_with_its_rules() -> None:
    """``deploy/prometheus/local.yml`` (Prometheus beside ``sift up``): valid, its rule files
    found (relative to it), and the dashboards' job names on ``sift up``'s default ports."""
    local = DEPLOY / "prometheus" / "local.yml"
    result = subprocess.run(
        [_promtool(), "check", "config", str(local)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr
    jobs = {job["job_name"]: job for job in load_yaml(local)["scrape_configs"]}
    defaults = Settings.model_fields  # the ports sift up uses unless told otherwise
    assert jobs[PROMETHEUS_JOB_GATEWAY]["static_configs"] == [
        {"targets": [f"127.0.0.1:{defaults['gateway_port'].default}"]}
    ]
    assert jobs[PROMETHEUS_JOB_WORKER]["static_configs"] == [
        {"targets": [f"127.0.0.1:{defaults['worker_metrics_port'].default}"]}
    ]


def test_prometheus_scrapes_the_gateway_and_every_worker() -> None:
    jobs = {job["job_name"]: job for job in load_yaml(PROMETHEUS)["scrape_configs"]}
    assert jobs["sift-gateway"]["static_configs"] == [{"targets": ["gateway:8080"]}]
    (dns,) = jobs["sift-worker"]["dns_sd_configs"]
    assert dns == {"names": ["worker"], "type": "A", "port": 9808, "refresh_interval": "15s"}


# --- kubernetes --------------------------------------------------------------------------


def _succeeds(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _read_kustomization(directory: Path) -> Iterator[dict[str, Any]]:
    """Without kubectl: the resources a kustomization lists, recursively (no transforms)."""
    kustomization = load_yaml(directory / "kustomization.yaml")
    namespace = kustomization.get("namespace")
    for entry in kustomization["resources"]:
        path = directory / entry
        if path.is_dir():
            docs = list(_read_kustomization(path))
        else:
            docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for doc in docs:
            if namespace and doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = namespace
            yield doc


def render(directory: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") and _succeeds(["kubectl", "version", "--client"]):
        result = subprocess.run(
            ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return list(_read_kustomization(directory))


ENTRY_POINTS = {"keda": K8S, "hpa": K8S / "hpa"}


@pytest.fixture(scope="module", params=sorted(ENTRY_POINTS))
def manifests(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(ENTRY_POINTS[request.param])


# KEDA's resources are CRDs: kubernetes-validate has no schema for them, so their shape is
# checked here against the fields KEDA 2.x requires.
KEDA_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string"},
                                "metadata": {
                                    "type": "object",
                                    "additionalProperties": {"type": "string"},
                                },
                                "authenticationRef": {
                                    "type": "object",
                                    "required": ["name"],
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    "TriggerAuthentication": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "spec": {
                "type": "object",
                "properties": {
                    "secretTargetRef": {
                        "type": "array",
                        "items": {"type": "object", "required": ["parameter", "name", "key"]},
                    }
                },
            },
        },
    },
}


def test_every_manifest_validates_against_its_schema(
    manifests: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = manifests
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(doc, KEDA_SCHEMAS[doc["kind"]])
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_base_file_is_listed_in_its_kustomization() -> None:
    for directory in (K8S / "base", K8S, K8S / "hpa"):
        listed = set(load_yaml(directory / "kustomization.yaml")["resources"])
        files = {p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"}
        assert files <= listed, f"{directory}: {files - listed} not listed"


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def test_workloads_have_probes_resources_and_run_as_non_root(
    manifests: tuple[str, list[dict[str, Any]]],
) -> None:
    docs = by_kind(manifests[1])
    for name in ("sift-gateway", "sift-worker"):
        deployment = docs["Deployment", name]
        assert deployment["metadata"]["namespace"] == "sift"
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        assert container["args"] == [name.removeprefix("sift-")]
        assert "livenessProbe" in container
        assert container["resources"]["requests"] and container["resources"]["limits"]
        refs = {next(iter(ref.values()))["name"] for ref in container["envFrom"]}
        assert refs == {"sift-config", "sift-secrets"}
        labels = deployment["spec"]["selector"]["matchLabels"]
        pdb = docs["PodDisruptionBudget", name]
        assert pdb["spec"]["selector"]["matchLabels"] == labels
    gateway = docs["Deployment", "sift-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    service = docs["Service", "sift-gateway"]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "sift-gateway"}


def test_the_worker_runs_one_process_per_requested_cpu(
    manifests: tuple[str, list[dict[str, Any]]],
) -> None:
    """A container sees its node's every core: the process count comes from its CPU request."""
    pod = by_kind(manifests[1])["Deployment", "sift-worker"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item for item in container["env"]}
    field = env["SIFT_WORKER_PROCESSES"]["valueFrom"]["resourceFieldRef"]
    assert field == {"containerName": container["name"], "resource": "requests.cpu",
                     "divisor": "1"}  # fmt: skip
    assert container["resources"]["requests"]["cpu"]


def test_every_deployment_keeps_the_metrics_folder_in_memory(
    compose: dict[str, Any], manifests: tuple[str, list[dict[str, Any]]]
) -> None:
    """The Dockerfile's ``PROMETHEUS_MULTIPROC_DIR`` in memory, in compose and in k8s: on the
    container's disk, a disk that filled killed every process of it with SIGBUS as it wrote a
    new series (deploy/README.md §2)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    folder = dockerfile.split("PROMETHEUS_MULTIPROC_DIR=", 1)[1].split()[0]
    for name in ("gateway", "worker"):
        mounts = [entry.split(":", 1)[0] for entry in compose["services"][name].get("tmpfs", [])]
        assert folder in mounts, (name, mounts)
    docs = by_kind(manifests[1])
    for name in ("sift-gateway", "sift-worker"):
        pod = docs["Deployment", name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory", (name, volume)


def test_the_worker_autoscaler_targets_the_worker_deployment(
    manifests: tuple[str, list[dict[str, Any]]],
) -> None:
    variant, docs = manifests
    kinds = by_kind(docs)
    if variant == "keda":
        scaled = kinds["ScaledObject", "sift-worker"]
        assert scaled["spec"]["scaleTargetRef"]["name"] == "sift-worker"
        redis_triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis"]
        lists = {t["metadata"]["listName"] for t in redis_triggers}
        assert lists == set(consumed_lists()), "a queue the workers consume has no trigger"
        # a pod out of CPU holds its searches inside (a message a thread, 300 a process):
        # the lists stay empty, so the CPU of the pods' requests scales too
        (cpu,) = [t for t in scaled["spec"]["triggers"] if t["type"] != "redis"]
        assert cpu["type"] == "cpu" and cpu["metricType"] == "Utilization", cpu
        assert 0 < int(cpu["metadata"]["value"]) < 100
        assert ("TriggerAuthentication", "sift-redis") in kinds
        assert not any(kind == "HorizontalPodAutoscaler" for kind, _ in kinds)
    else:
        hpa = kinds["HorizontalPodAutoscaler", "sift-worker"]
        assert hpa["spec"]["scaleTargetRef"]["name"] == "sift-worker"
        assert not any(kind == "ScaledObject" for kind, _ in kinds)


def _upgrade_commands() -> str:
    """The commands deploy/README.md §8 gives to stop the workers before an upgrade."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## 8. Upgrading") :]
    start = section.index("**Stopping the workers first on Kubernetes.**")
    block = section[section.index("```bash", start) :]
    return block[: block.index("```", len("```bash"))]


def test_the_upgrade_steps_take_the_workers_from_their_autoscaler_by_its_manifest_names(
    manifests: tuple[str, list[dict[str, Any]]],
) -> None:
    """§8's steps for an upgrade that stops the workers first: the autoscaler of each
    variant would bring a worker scaled to 0 back (or the Deployment rolls them), so the
    steps pause KEDA at 0 (autoscaling.keda.sh/paused-replicas, then remove it) or remove
    the HPA, naming the objects, namespace and pod labels the manifests define."""
    variant, docs = manifests
    kinds = by_kind(docs)
    commands = _upgrade_commands()
    worker = kinds["Deployment", "sift-worker"]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert "strategy" not in worker["spec"], "the workers no longer roll: revise §8"
    namespace = worker["metadata"]["namespace"]
    assert {namespace} == set(re.findall(r"kubectl -n (\S+)", commands))
    (label,) = re.findall(r"-l (\S+)=(\S+)", commands)
    assert labels[label[0]] == label[1]
    if variant == "keda":
        assert kinds["ScaledObject", "sift-worker"]["spec"]["minReplicaCount"] > 0
        pause = "annotate scaledobject sift-worker autoscaling.keda.sh/paused-replicas"
        assert f'{pause}="0"' in commands and f"{pause}-" in commands
    else:
        assert kinds["HorizontalPodAutoscaler", "sift-worker"]["spec"]["minReplicas"] > 0
        assert "delete hpa sift-worker" in commands
        assert "apply -k deploy/k8s " in commands and "deploy/k8s/hpa" in commands


def consumed_lists() -> list[str]:
    """The Redis lists the workers take messages from: every queue ``sift worker`` consumes
    by default (``-Q``: ALL_QUEUES, as in Celery's ``task_queues``), each in its own list
    only, as no message is sent with a priority (kombu's other lists stay empty)."""
    config = celery_config(load_settings(redis_url="redis://localhost:6379/0"))
    queues = [queue.name for queue in config["task_queues"]]
    assert queues == list(ALL_QUEUES)
    assert {route["queue"] for route in TASK_ROUTES.values()} <= set(queues)
    assert not {"task_default_priority", "task_queue_max_priority"} & set(config)
    return [kombu_queue_keys(queue)[0] for queue in queues]


PLACEHOLDER_SECRET = "whsec_Q0hBTkdFLU1FLXdlYmhvb2stc2VjcmV0"  # base64 of CHANGE-ME-webhook-secret
OWN_SECRET = "whsec_b3duLXdlYmhvb2stc2VjcmV0LTAxMjM0NTY3"


def test_the_secret_holds_only_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = load_yaml(K8S / "base" / "secret.yaml")
    assert "PLACEHOLDERS ONLY" in (K8S / "base" / "secret.yaml").read_text()
    for key, value in secret["stringData"].items():
        if "URL" in key and "@" not in value:
            continue  # a URL without credentials
        assert "CHANGE-ME" in value, key
    # the webhook secret's placeholder (base64: its CHANGE-ME not visible) stops a pod
    assert PLACEHOLDER_SECRET in secret["stringData"]["SIFT_API_KEYS"]
    monkeypatch.setenv("SIFT_API_KEYS", secret["stringData"]["SIFT_API_KEYS"])
    with pytest.raises(ConfigError, match="webhook_secret: the placeholder"):
        load_settings()


def test_every_pod_loads_its_settings_beside_the_service_links_of_its_namespace(
    manifests: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's environment as the kubelet makes it: the service links of every Service with a
    cluster IP in the namespace (sift-gateway gives SIFT_GATEWAY_PORT=tcp://...), then its
    own variables (envFrom, env), which win. Every SIFT_ one must be a setting or let be,
    and each setting valid: else every pod stops at start-up."""
    _, docs = manifests
    data = {
        (doc["kind"], doc["metadata"]["name"]): {**doc.get("data", {}), **doc.get("stringData", {})}
        for doc in docs
        if doc["kind"] in ("ConfigMap", "Secret")
    }
    links: dict[str, str] = {}
    for n, doc in enumerate(d for d in docs if d["kind"] == "Service"):
        if doc["spec"].get("clusterIP") != "None":  # a headless Service has no links
            ports = [(p.get("name", ""), p["port"]) for p in doc["spec"]["ports"]]
            links |= service_links(doc["metadata"]["name"], f"10.96.0.{n + 1}", ports)
    pods = [d for d in docs if d["kind"] == "Deployment"]
    assert pods and links
    for pod in pods:
        (container,) = pod["spec"]["template"]["spec"]["containers"]
        env = dict(links)
        for source in container.get("envFrom", []):
            kind, ref = next(iter(source.items()))
            env |= data[("ConfigMap" if kind == "configMapRef" else "Secret", ref["name"])]
        env |= {e["name"]: e.get("value", "1") for e in container.get("env", [])}
        # the Secret's webhook secret replaced, as its user must: the placeholder is refused
        env["SIFT_API_KEYS"] = env["SIFT_API_KEYS"].replace(PLACEHOLDER_SECRET, OWN_SECRET)
        for name in [name for name in os.environ if name.upper().startswith("SIFT_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            if name.startswith("SIFT_"):
                monkeypatch.setenv(name, value)
        load_settings()


def test_every_compose_sift_service_loads_its_settings(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's and the worker's environment as ``docker compose`` makes it from
    deploy/.env.example (each ``${VAR:-default}`` and ``${VAR:?}`` read there, or its
    default): every SIFT_ value a valid setting, as the pods' above. The names alone were
    checked (test_docs_match_code.py), so a value the settings stop taking (a quantization
    or an analyzer renamed) stopped every container at start with no test to say so."""
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    example["SIFT_API_KEYS"] = example["SIFT_API_KEYS"].replace(PLACEHOLDER_SECRET, OWN_SECRET)

    def interpolated(value: object) -> str:
        def variable(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(3) or ""
            return example.get(name, default if match.group(2) == ":-" else "")

        return re.sub(r"\$\{([A-Z_]+)(?:(:[-?])([^}]*))?\}", variable, str(value))

    for name in ("gateway", "worker"):
        env = {k: interpolated(v) for k, v in compose["services"][name]["environment"].items()}
        assert env["SIFT_API_KEYS"].startswith("[{"), env  # read from the example
        for variable in [v for v in os.environ if v.upper().startswith("SIFT_")]:
            monkeypatch.delenv(variable)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        settings = load_settings()
        assert settings.search_backend == "elasticsearch", name


def test_the_compose_workers_fit_the_memory_the_readme_asks_for(compose: dict[str, Any]) -> None:
    """``sift worker`` starts a process per core it sees, and a compose container sees every
    core of its host: unset, each replica ran one per host core (2 replicas on an 8-core
    laptop: 16 processes, ~9 GB at docs/reliability.md's ~600 MB each), not the "about 4 GB"
    deploy/README.md asks for. The compose file fixes the count (deploy/.env may change it).
    Redis's ``maxmemory`` counts too: it is what Redis may hold, and below the host's free
    memory its ``noeviction`` refuses writes before the OOM killer stops it (the 4 GB asked
    for left out its 2 GB: the workers, the heap and a Redis at its limit need 5.4)."""
    worker = compose["services"]["worker"]
    setting = str(worker["environment"].get("SIFT_WORKER_PROCESSES", ""))
    fixed = re.fullmatch(r"\$\{SIFT_WORKER_PROCESSES:-([1-9]\d*)\}", setting)
    assert fixed, f"the worker's process count follows the host's cores: {setting!r}"
    processes = int(fixed.group(1)) * int(worker["deploy"]["replicas"])
    heap = re.search(r"\$\{ES_HEAP:-(\d+)g\}", COMPOSE.read_text())
    asked = re.search(r"about (\d+) GB of free memory", (DEPLOY / "README.md").read_text())
    assert heap and asked
    redis = re.search(r"\$\{REDIS_MAXMEMORY:-(\d+)gb\}", COMPOSE.read_text())
    assert redis, "Redis's maxmemory is no longer read here"
    # GB: the workers' RSS, Elasticsearch's heap, what Redis may hold
    needs = processes * 0.6 + int(heap.group(1)) + int(redis.group(1))
    assert needs <= int(asked.group(1)), (processes, needs)
    example = (DEPLOY / ".env.example").read_text()
    assert re.search(rf"^SIFT_WORKER_PROCESSES={fixed.group(1)}$", example, re.MULTILINE)


def _probe_exit(command: list[str], metrics: str | None) -> int:
    """The exit status of a worker probe's command against a ``/metrics`` answering
    ``metrics`` (None: nothing listening)."""
    port = free_port()
    server = None
    if metrics is not None:
        body = metrics.encode()

        class Metrics(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", port), Metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "SIFT_WORKER_METRICS_PORT": str(port)}
        return subprocess.run([sys.executable, *command[1:]], env=env, timeout=30).returncode
    finally:
        if server is not None:
            server.shutdown()


def test_the_worker_probes_fail_while_every_worker_process_is_down(
    compose: dict[str, Any], manifests: tuple[str, list[dict[str, Any]]]
) -> None:
    """The supervisor serves ``/metrics`` while its processes crash-loop: a probe that only
    asked whether it answered said healthy, and Kubernetes never restarted the pod. Both
    files run one check: it fails with none of the processes running, or no answer."""
    test = compose["services"]["worker"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    worker = by_kind(manifests[1])["Deployment", "sift-worker"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["exec"]["command"] == test[1:]
    up = '# TYPE sift_worker_processes gauge\nsift_worker_processes{state="running"} 2.0\n'
    down = (
        'sift_worker_processes{state="expected"} 2.0\nsift_worker_processes{state="running"} 0.0\n'
    )
    assert _probe_exit(test[1:], up) == 0
    assert _probe_exit(test[1:], "sift_jobs_in_flight 0.0\n") == 0  # one process: none kept
    assert _probe_exit(test[1:], down) == 1
    assert _probe_exit(test[1:], None) != 0
