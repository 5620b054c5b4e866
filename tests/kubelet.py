"""What the kubelet gives a pod: the service-link variables of its namespace's Services."""

from __future__ import annotations


def service_links(service: str, cluster_ip: str, ports: list[tuple[str, int]]) -> dict[str, str]:
    """The variables the kubelet gives every pod of the namespace for a Service with a
    cluster IP (kubernetes pkg/kubelet/envvars FromServices: the Service's name upper-cased,
    its dashes made underscores; Docker's link variables for each port, the first as _PORT)."""
    prefix = service.upper().replace("-", "_")
    env = {f"{prefix}_SERVICE_HOST": cluster_ip, f"{prefix}_SERVICE_PORT": str(ports[0][1])}
    for i, (name, port) in enumerate(ports):
        env[f"{prefix}_SERVICE_PORT_{name.upper().replace('-', '_')}"] = str(port)
        link = f"{prefix}_PORT_{port}_TCP"
        env.update({link: f"tcp://{cluster_ip}:{port}", f"{link}_PROTO": "tcp"})
        env.update({f"{link}_PORT": str(port), f"{link}_ADDR": cluster_ip})
        if i == 0:
            env[f"{prefix}_PORT"] = f"tcp://{cluster_ip}:{port}"
    return env
