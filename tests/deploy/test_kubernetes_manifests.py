"""The plain Kubernetes manifests under deploy/kubernetes: schema-valid for a current Kubernetes, and consistent."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.deploy_checks import (
    DEPLOY,
    KUBERNETES_VERSION,
    SERVICE_MONITOR_SCHEMA,
    by_kind,
    check_server_deployment,
    load_yaml_documents,
    server_args,
    validate_kubernetes_object,
)

MANIFESTS = sorted((DEPLOY / "kubernetes").rglob("*.yaml"))
# Helm values for the prometheus-community/prometheus-adapter chart, not a Kubernetes object.
NOT_OBJECTS = {"prometheus-adapter-values.yaml"}


def objects() -> list[dict]:
    return [obj for path in MANIFESTS if path.name not in NOT_OBJECTS
            for obj in load_yaml_documents(path.read_text())]


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.name not in NOT_OBJECTS], ids=lambda p: p.name)
def test_manifest_validates(path):
    docs = load_yaml_documents(path.read_text())
    assert docs
    for obj in docs:
        validate_kubernetes_object(obj)


def test_validation_rejects_mistakes():
    (deployment,) = by_kind(objects())["Deployment"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    (monitor,) = by_kind(objects())["ServiceMonitor"]
    broken = yaml.safe_load(yaml.safe_dump(monitor))
    broken["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)


def test_objects_fit_together():
    kinds = by_kind(objects())
    (deployment,) = kinds["Deployment"]
    (service,) = kinds["Service"]
    (monitor,) = kinds["ServiceMonitor"]
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    container = check_server_deployment(deployment)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # The Service reaches the pods, and the ServiceMonitor finds the Service's named port.
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    # Annotation-based scraping points at the server's port.
    port = server_args(container)["--port"]
    for notes in (service["metadata"]["annotations"], deployment["spec"]["template"]["metadata"]["annotations"]):
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == port
    # The HPA scales this Deployment on queued requests per pod.
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    # ...which the adapter rule derives from the server's vllm:num_requests_waiting.
    adapter = yaml.safe_load((DEPLOY / "kubernetes/autoscaling/prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert (rule["name"]["matches"], rule["name"]["as"]) == ("^vllm:(.*)$", "vllm_${1}")
