"""The Helm chart, rendered by Helm itself (Helm's Go SDK through helm-python-sdk), and the objects it makes."""

from __future__ import annotations

import base64

import pytest
import yaml

from helpers.deploy_checks import (
    CHART,
    KUBERNETES_VERSION,
    by_kind,
    check_server_deployment,
    load_yaml_documents,
    server_args,
    validate_kubernetes_object,
)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (test extra) bundles Helm's library")

GPU_AUTOSCALING_VALUES = CHART / "ci" / "gpu-autoscaling-values.yaml"


def render(values: dict | None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="demo", namespace="llm")
    return [obj for path, text in sorted(manifests.items()) if path.endswith((".yaml", ".yml"))
            for obj in load_yaml_documents(text)]


@pytest.fixture(scope="module")
def default_objects() -> list[dict]:
    return render(None)


@pytest.fixture(scope="module")
def gpu_objects() -> list[dict]:
    return render(yaml.safe_load(GPU_AUTOSCALING_VALUES.read_text()))


def test_helm_is_real():
    # Helm's own SDK (v3 or later) does the rendering, with Go template semantics.
    assert int(helm.helm_sdk_version().lstrip("v").split(".")[0]) >= 3


@pytest.mark.parametrize("values", [None, GPU_AUTOSCALING_VALUES], ids=["default", "gpu-autoscaling"])
def test_lint_clean(values):
    loaded = yaml.safe_load(values.read_text()) if values else None
    report = helm.lint(CHART, loaded, strict=True, kube_version=KUBERNETES_VERSION)
    assert not report["errors"], report
    # Severity 1 is INFO (e.g. "icon is recommended"); nothing at WARNING or above.
    assert all(m["severity"] <= 1 for m in report["messages"]), report


def test_default_values(default_objects):
    for obj in default_objects:
        validate_kubernetes_object(obj)
    kinds = by_kind(default_objects)
    # Tests hooks are rendered too; without them: a Deployment and its Service, nothing optional.
    assert sorted(k for k in kinds if k != "Pod") == ["Deployment", "Service"]
    (deployment,) = kinds["Deployment"]
    container = check_server_deployment(deployment)
    assert container["image"] == "pagedllm:cpu"
    assert deployment["spec"]["replicas"] == 1
    flags = server_args(container)
    assert "--device" not in flags and "env" not in container  # CPU, no API key
    assert not any(k.startswith("nvidia.com/") for k in container["resources"].get("limits", {}))
    (test_pod,) = kinds["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"


def test_gpu_autoscaling_values(gpu_objects):
    for obj in gpu_objects:
        validate_kubernetes_object(obj)
    kinds = by_kind(gpu_objects)
    (deployment,) = kinds["Deployment"]
    container = check_server_deployment(deployment)
    assert container["image"] == "registry.example.com/pagedllm:cuda-0.1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["args"][0] == "/models/Llama-3.2-1B-Instruct"
    flags = server_args(container)
    assert flags["--device"] == "cuda" and flags["--served-model-name"] == "llama-3.2-1b"
    assert flags["--max-model-len"] == "8192"
    # The HPA owns the replica count.
    assert "replicas" not in deployment["spec"]
    (hpa,) = kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    # API key from the existing Secret; the chart makes no Secret of its own.
    (env,) = container["env"]
    assert env["name"] == "PAGEDLLM_API_KEY"
    assert env["valueFrom"]["secretKeyRef"] == {"name": "pagedllm-api-key", "key": "api-key"}
    assert "Secret" not in kinds
    # The model volume is a claim the chart created, mounted read-only where the model path points.
    (pvc,) = kinds["PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["models"]["readOnly"] and container["args"][0].startswith(mounts["models"]["mountPath"] + "/")
    (monitor,) = kinds["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (service,) = kinds["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_api_key_value_makes_a_secret():
    kinds = by_kind(render({"apiKey": {"value": "s3cret"}}))
    (secret,) = kinds["Secret"]
    validate_kubernetes_object(secret)
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret"
    (container,) = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"]
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]


@pytest.mark.parametrize("bad", [
    {"replicaCount": -1},
    {"gpu": {"enabled": "yes"}},
    {"server": {"port": 70000}},
    {"resources": {"limits": {"memory": "lots"}}},
    {"modle": {"name": "typo"}},
    {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
], ids=lambda v: next(iter(v)))
def test_bad_values_are_rejected(bad):
    with pytest.raises(helm.HelmError):
        render(bad)
