"""Plain YAML under deploy/: yamllint clean; the compose file matches the Compose specification."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml

from helpers.deploy_checks import DEPLOY, REPO_ROOT

YAMLLINT_CONFIG = DEPLOY / ".yamllint.yaml"
COMPOSE = DEPLOY / "docker" / "compose.yaml"


def plain_yaml_files() -> list[Path]:
    templates = DEPLOY / "helm" / "pagedllm" / "templates"
    return sorted(p for p in DEPLOY.rglob("*.y*ml") if templates not in p.parents)


def yamllint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-f", "parsable", "-c",
                           str(YAMLLINT_CONFIG), *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_yamllint_clean():
    files = plain_yaml_files()
    names = {p.relative_to(DEPLOY).as_posix() for p in files}
    # The files the deployment consists of are all covered.
    assert {"docker/compose.yaml", "kubernetes/deployment.yaml", "kubernetes/service.yaml",
            "kubernetes/monitoring/servicemonitor.yaml", "kubernetes/autoscaling/hpa.yaml",
            "helm/pagedllm/values.yaml", "helm/pagedllm/Chart.yaml", "prometheus/prometheus.yml",
            "grafana/provisioning/datasources/prometheus.yaml"} <= names
    result = yamllint(*files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_catches_problems(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\nb:   [1,2]\n")
    assert yamllint(bad).returncode != 0


def test_compose_matches_the_compose_spec():
    from check_jsonschema.builtin_schemas import get_builtin_schema

    compose = yaml.safe_load(COMPOSE.read_text())
    spec = get_builtin_schema("vendor.compose-spec")
    jsonschema.validate(compose, spec)
    misspelt = yaml.safe_load(COMPOSE.read_text())
    misspelt["services"]["pagedllm"]["helthcheck"] = {}
    assert not jsonschema.validators.validator_for(spec)(spec).is_valid(misspelt)
    services = compose["services"]
    assert set(services) == {"pagedllm", "prometheus", "grafana"}
    # Files the stack mounts or builds from exist (paths are relative to the compose file).
    base = COMPOSE.parent
    build = services["pagedllm"]["build"]
    assert (base / build["context"] / build["dockerfile"]).resolve().is_file()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (base / source).resolve().exists(), source
    # Grafana gets the dashboard and a Prometheus data source that points at the compose service.
    grafana_mounts = " ".join(services["grafana"]["volumes"])
    assert "pagedllm-dashboard.json" in grafana_mounts and "provisioning" in grafana_mounts
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["pagedllm:8000"] and scrape["metrics_path"] == "/metrics"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pagedllm.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    # The server drains for --shutdown-timeout on SIGTERM; compose must wait longer before SIGKILL.
    args = services["pagedllm"]["command"]
    drain = float(args[args.index("--shutdown-timeout") + 1])
    assert float(services["pagedllm"]["stop_grace_period"].rstrip("s")) > drain
    assert (REPO_ROOT / ".dockerignore").is_file()
