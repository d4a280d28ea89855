"""deploy/ray: the KubeRay RayCluster's pod templates are valid Kubernetes pod specs, the Service reaches the head's
server port, and the head runs `pagedllm serve` with the Ray data-parallel backend on flags the CLI knows."""

from __future__ import annotations

import argparse

from helpers.deploy_checks import DEPLOY, by_kind, load_yaml_documents, validate_kubernetes_object

MANIFEST = DEPLOY / "ray" / "raycluster.yaml"


def _objects() -> dict[str, list[dict]]:
    return by_kind(load_yaml_documents(MANIFEST.read_text()))


def test_pod_templates_and_service_validate() -> None:
    kinds = _objects()
    (cluster,) = kinds["RayCluster"]
    templates = [cluster["spec"]["headGroupSpec"]["template"],
                 *(g["template"] for g in cluster["spec"]["workerGroupSpecs"])]
    for template in templates:  # a RayCluster is a custom resource: its pod templates are Kubernetes' own
        validate_kubernetes_object({"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"],
                                    "spec": template["spec"]})
    (service,) = kinds["Service"]
    validate_kubernetes_object(service)
    head = cluster["spec"]["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    ports = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in ports


def test_head_serves_with_flags_the_cli_knows() -> None:
    from pagedllm.engine_args import EngineArgs

    (cluster,) = _objects()["RayCluster"]
    script = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
    serve = script.split("exec pagedllm serve", 1)[1].split()
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(serve)
    assert args.data_parallel_backend == "ray" and args.data_parallel_size == 2
