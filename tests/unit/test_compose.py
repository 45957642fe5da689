"""docker-compose.yml: the services of the design, one worker pinned per GPU; valid for compose."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from e31.edge.settings import Settings

ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def test_compose_has_every_service_and_pins_one_gpu_per_worker() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"redis", "postgres", "api", "scheduler", "flower"} <= set(services)
    gpu_workers = {name: s for name, s in services.items() if name.startswith("worker-gpu")}
    assert len(gpu_workers) >= 1
    pinned = []
    for service in gpu_workers.values():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        pinned.append(device["device_ids"][0])
    assert len(set(pinned)) == len(pinned), "two workers share a GPU"


def test_flower_is_published_on_loopback_only() -> None:
    flower = yaml.safe_load(COMPOSE.read_text())["services"]["flower"]
    assert all(str(p).startswith("127.0.0.1:") for p in flower.get("ports", []))


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"],
                            env=dict(os.environ, E31_FLOWER_PASSWORD="x",
                                     E31_GRAFANA_PASSWORD="y"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


SECRET_PATH = "/run/secrets/redis_password"


def e31_services() -> dict[str, dict[str, Any]]:
    """The services that run `e31` (the project's image): every one talks to Redis."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {name: s for name, s in services.items() if s.get("image") == "e31-batch:local"}


def test_redis_requires_the_password_of_a_compose_secret_and_never_on_a_command_line() -> None:
    # Given the compose file
    compose = yaml.safe_load(COMPOSE.read_text())
    redis = compose["services"]["redis"]

    # Then Redis mounts the secret and reads its configuration, with the password, from
    # standard input ("-"): nothing in its argv, which `ps` shows the whole host
    assert redis["secrets"] == ["redis_password"]
    script = redis["entrypoint"][-1]
    assert "redis-server - " in script
    assert f'requirepass "$$(cat {SECRET_PATH})"' in script
    assert "requirepass" not in " ".join(redis.get("command", []))
    # And its health check authenticates through the environment, not the argv
    assert "REDISCLI_AUTH=" in redis["healthcheck"]["test"][-1]
    assert compose["secrets"]["redis_password"]["file"]


def test_every_e31_service_reads_the_redis_password_from_the_secret() -> None:
    services = e31_services()
    assert {"api", "scheduler", "flower", "migrate", "worker-cpu"} <= set(services)
    for name, service in services.items():
        env = service["environment"]
        assert "redis_password" in service["secrets"], name
        assert env["E31_REDIS_PASSWORD_FILE"] == SECRET_PATH, name
        assert urlsplit(env["E31_REDIS_URL"]).password is None, name  # no password in the file


def test_settings_put_the_secret_into_each_services_redis_url(tmp_path: Path) -> None:
    # Given an API container's environment, with the secret where compose mounts it
    secret = tmp_path / "redis_password"
    secret.write_text("0f1e2d3c4b5a\n")
    token = tmp_path / "metrics_token"
    token.write_text("9a8b7c\n")
    env = {k: str(v) for k, v in e31_services()["api"]["environment"].items()}
    env.update(E31_HOME=str(tmp_path), E31_REDIS_PASSWORD_FILE=str(secret),
               E31_METRICS_TOKEN_FILE=str(token))

    # When the process loads its settings
    settings = Settings.load(environ=env)

    # Then its Redis URL carries the password (and a URL that has one keeps its own)
    assert settings.redis_url == "redis://:0f1e2d3c4b5a@redis:6379/0"
    env["E31_REDIS_URL"] = "redis://:own@elsewhere:6379/0"
    assert Settings.load(environ=env).redis_url == "redis://:own@elsewhere:6379/0"


DOCKERFILE = COMPOSE.with_name("Dockerfile")
SANDBOX_CAPS = {"SETUID", "SETGID", "CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL",
                "SYS_ADMIN", "NET_ADMIN"}   # the last two: each job's own network namespace


def test_the_image_installs_bubblewrap_for_the_sandbox() -> None:
    assert ("apt-get install -y --no-install-recommends bubblewrap slirp4netns"
            in DOCKERFILE.read_text())


def test_workers_run_as_root_with_only_the_capabilities_the_sandbox_needs() -> None:
    # Given the compose file's worker services (one per GPU, and the cpu one)
    workers = {n: s for n, s in e31_services().items() if n.startswith("worker-")}
    assert {"worker-gpu0", "worker-cpu"} <= set(workers)
    for name, service in workers.items():
        # Then each runs as root (to start jobs as their tenants' uids), drops every
        # capability but the sandbox's and the job network's (and the tun device for
        # slirp4netns), without privileged mode, and lifts only
        # the seccomp and AppArmor profiles that refuse bubblewrap's user namespace
        assert str(service["user"]).split(":")[0] == "0", name
        assert service["cap_drop"] == ["ALL"], name
        assert set(service["cap_add"]) == SANDBOX_CAPS, name
        assert not service.get("privileged"), name
        assert service["devices"] == ["/dev/net/tun:/dev/net/tun"], name
        assert set(service["security_opt"]) == {"seccomp=unconfined", "apparmor=unconfined"}
        # and runs the command it is given, under a umask that keeps its files on the shared
        # volume removable by the other services (group e31)
        assert service["entrypoint"][:2] == ["sh", "-c"] and "umask 0002" in \
            service["entrypoint"][2], name
        assert service["command"][:2] == ["e31", "worker"], name


def test_no_other_service_gets_root_or_extra_capabilities() -> None:
    for name, service in e31_services().items():
        if name.startswith("worker-"):
            continue
        assert "user" not in service and "cap_add" not in service, name
        assert "security_opt" not in service, name


def test_prometheus_and_grafana_are_wired_to_config_and_published_on_loopback_only() -> None:
    # Given the compose file
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]

    # Then both answer on the host's loopback only (neither UI has a login worth the name for
    # Prometheus; Grafana's is its admin password)
    for service in (prometheus, grafana):
        assert service["ports"] and all(str(p).startswith("127.0.0.1:") for p in service["ports"])
    # And Prometheus reads config/prometheus (scrape configuration and alert rules)
    assert "./config/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    # And Grafana its provisioning (data source, dashboard provider) and the dashboards where
    # the provider looks for them
    assert "./config/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    provider = yaml.safe_load((ROOT / "config/grafana/provisioning/dashboards/e31.yml")
                              .read_text())["providers"][0]
    assert f"./config/grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    source = yaml.safe_load((ROOT / "config/grafana/provisioning/datasources/prometheus.yml")
                            .read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].endswith(":?set it}")


def test_prometheus_presents_the_metrics_token_the_api_reads_and_scrapes_the_api() -> None:
    # Given the compose file and Prometheus's scrape configuration
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    config = yaml.safe_load((ROOT / "config/prometheus/prometheus.yml").read_text())
    [scrape] = [c for c in config["scrape_configs"] if c["job_name"] == "e31"]

    # Then the API reads its /metrics token from the secret Prometheus presents as a bearer
    token_path = "/run/secrets/metrics_token"
    assert services["api"]["environment"]["E31_METRICS_TOKEN_FILE"] == token_path
    assert "metrics_token" in services["api"]["secrets"]
    assert "metrics_token" in services["prometheus"]["secrets"]
    assert scrape["authorization"] == {"type": "Bearer", "credentials_file": token_path}
    assert compose["secrets"]["metrics_token"]["file"]
    # And it scrapes the API where compose runs it; Flower (its /metrics names every tenant's
    # tasks, behind Flower's login) is no target
    targets = [t for c in config["scrape_configs"] for s in c["static_configs"]
               for t in s["targets"]]
    assert "api:8031" in targets
    assert not any(t.startswith("flower") for t in targets)


NODE_SETTINGS = {"E31_DATABASE_URL", "E31_REDIS_URL", "E31_REDIS_PASSWORD_FILE",
                 "E31_ARTIFACTS_URL", "E31_S3_ENDPOINT_URL", "E31_S3_ACCESS_KEY_ID",
                 "E31_S3_SECRET_ACCESS_KEY", "E31_HOME"}


def test_a_gpu_host_joins_with_the_worker_only_profile_and_the_node_settings_alone() -> None:
    # Given the worker-only service of a GPU host
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    node = services["worker-node"]

    # Then it runs only with its profile, waits for no service of this file, keeps only its own
    # scratch volume (no disk shared with the control plane), takes all the host's GPUs, and
    # is configured by the store, broker and artifact store settings (and S3's) alone
    assert node["profiles"] == ["gpu-node"] and not node.get("depends_on")
    assert node["command"][:2] == ["e31", "worker"] and "--hostname" in node["command"]
    assert [v.split(":")[0] for v in node["volumes"]] == ["e31-node"]
    [device] = node["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == "all" and device["capabilities"] == ["gpu"]
    assert {k for k in node["environment"] if k.startswith("E31_")} == NODE_SETTINGS
    assert "redis_password" in node["secrets"]
    # ... which are settings the worker reads (none misspelt), and the image has s3fs for them
    env = {k: "x" for k in NODE_SETTINGS - {"E31_REDIS_PASSWORD_FILE"}}
    settings = Settings.load(environ=dict(env, E31_ARTIFACTS_URL="s3://b/p"))
    assert settings.s3_endpoint_url == settings.s3_access_key_id == "x"
    assert '".[worker,postgres,s3]"' in (ROOT / "Dockerfile").read_text()
    # and the pool's other services are not in the profile: a node runs none of them
    assert all("profiles" not in s for name, s in services.items() if name != "worker-node")


def test_the_docs_point_the_cli_at_the_port_compose_publishes_for_the_api() -> None:
    # Given the API's published port (issue 32: a runbook said 8000, Compose publishes 8031)
    api = yaml.safe_load(COMPOSE.read_text())["services"]["api"]
    published = {str(p).rsplit(":", 2)[-2] for p in api["ports"]}
    # Then every `E31_URL=http://localhost:<port>` of the docs names it
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    said = {(page.name, url.port) for page in pages
            for url in map(urlsplit, re.findall(r"E31_URL=(http://(?:localhost|127\.0\.0\.1)"
                                                r":\d+)", page.read_text()))}
    assert said, "no page shows E31_URL"
    assert {(name, str(port)) for name, port in said if str(port) not in published} == set()
