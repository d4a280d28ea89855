"""Shared helpers for the deployment tests: file locations, YAML loading, Kubernetes schema validation.

A module of its own (not conftest.py) so test modules can import it by a name no other test folder uses.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
CHART = DEPLOY / "helm" / "pagedllm"
DASHBOARD = DEPLOY / "grafana" / "pagedllm-dashboard.json"
# A current Kubernetes release; kubernetes-validate ships its OpenAPI schemas.
KUBERNETES_VERSION = "1.37.0"

# Duration as the Prometheus Operator's CRDs define it (e.g. 15s, 1m30s).
_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
# The part of the monitoring.coreos.com/v1 ServiceMonitor CRD that these manifests use. kubernetes-validate has
# only built-in kinds, so the custom resource is checked against this subset of its published schema.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"}}},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "targetPort": {"type": ["string", "integer"]},
                                   "path": {"type": "string", "pattern": "^/"},
                                   "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                                   "interval": {"type": "string", "pattern": _DURATION},
                                   "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                                   "honorLabels": {"type": "boolean"},
                                   "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"}}}},
            },
        },
    },
}


def load_yaml_documents(text: str) -> list[dict[str, Any]]:
    """All non-empty documents of a multi-document YAML string."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def validate_kubernetes_object(obj: dict[str, Any]) -> None:
    """Raise if ``obj`` is not a valid object of a current Kubernetes (strict: unknown fields fail too)."""
    import jsonschema
    import kubernetes_validate

    if obj.get("kind") == "ServiceMonitor":
        # A custom resource: not in Kubernetes' own schemas (kubernetes-validate raises SchemaNotFoundError).
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def by_kind(objects: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], []).append(obj)
    return kinds


def server_args(container: dict[str, Any]) -> dict[str, str]:
    """``--flag value`` pairs of a pagedllm container's args (flags without a value map to "")."""
    args, flags, i = container.get("args", []), {}, 0
    while i < len(args):
        if args[i].startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            flags[args[i]] = args[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            i += 1
    return flags


def check_server_deployment(deployment: dict[str, Any]) -> dict[str, Any]:
    """What every pagedllm Deployment must do; returns its server container."""
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "pagedllm"]
    flags = server_args(container)
    port = int(flags["--port"])
    assert any(p["containerPort"] == port for p in container["ports"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in ("http", port), probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "startup probe too short for model load"
    # The pod must outlive preStop + the server's own drain, or in-flight requests are killed.
    drain = float(flags["--shutdown-timeout"])
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > drain + pre_stop
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    return container


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())
