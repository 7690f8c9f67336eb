"""scripts/k8s/gateway.yaml (untested on a cluster) checked statically: it parses, the gateway's
arguments parse with sglang-router's own parser into service discovery of the worker pods, the
worker's arguments parse with radixlm-server's, and labels, ports and probes agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from radixlm.launch_server import build_parser
from radixlm.runtime.server_args import ServerArgs
from tests.helpers import missing_dependency

MANIFEST = Path(__file__).resolve().parents[2] / "scripts" / "k8s" / "gateway.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text())}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_the_gateway_discovers_the_worker_pods(docs):
    try:
        from sglang_router.launch_router import parse_router_args
    except ImportError as e:
        missing_dependency(f"sglang-router not installed: {e}")
    worker = docs[("Deployment", "radixlm-worker")]
    gateway = docs[("Deployment", "radixlm-gateway")]
    args = parse_router_args(container(gateway)["args"])
    assert args.service_discovery and args.policy == "cache_aware"
    assert args.selector == worker["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery_namespace == worker["metadata"]["namespace"]
    assert args.service_discovery_port == container(worker)["ports"][0]["containerPort"]
    assert "sglang-router==0.3.2" in " ".join(container(gateway)["command"])   # the version parsed here
    # it may list and watch pods in that namespace
    account = gateway["spec"]["template"]["spec"]["serviceAccountName"]
    binding = docs[("RoleBinding", "radixlm-gateway-pod-reader")]
    assert binding["subjects"][0]["name"] == account
    (rule,) = docs[("Role", binding["roleRef"]["name"])]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    service = docs[("Service", "radixlm-gateway")]
    assert service["spec"]["selector"] == gateway["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == args.port


def test_the_worker_arguments_and_probes(docs):
    worker = container(docs[("Deployment", "radixlm-worker")])
    assert worker["command"] == ["radixlm-server"]
    server_args = ServerArgs.from_cli_args(build_parser().parse_args(worker["args"]))
    assert server_args.host == "0.0.0.0" and server_args.port == worker["ports"][0]["containerPort"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": server_args.port}
