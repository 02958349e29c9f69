"""The Kubernetes example: the manifests load into the kubernetes client's models with no
field dropped (a misspelt or misplaced key would be), and they fit together: the
Service finds the Job's pods, the workers' peer is the Service's DNS name, the command is
one `ftcomm run` accepts, the grace period outlasts the launcher's stop timeout."""

from __future__ import annotations

import pathlib

import kubernetes
import pytest
import yaml

from ftcomm.gossip.addresses import parse_seed
from ftcomm.ops.cli import build_parser

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
KINDS = {"Service": "V1Service", "Job": "V1Job"}


def model(document: dict):
    api = kubernetes.client.ApiClient()
    built = api._ApiClient__deserialize(document, KINDS[document["kind"]])
    assert api.sanitize_for_serialization(built) == document, "a field was not recognised by the model"
    return built


def manifests() -> dict[str, dict]:
    return {path.stem: yaml.safe_load(path.read_text()) for path in sorted(EXAMPLE.glob("*.yaml"))}


def test_every_manifest_is_a_valid_object_of_its_kind():
    docs = manifests()
    assert set(docs) == {"service", "job"}
    for document in docs.values():
        model(document)


def test_a_misspelt_field_is_caught():
    document = manifests()["service"]
    document["spec"]["publishNotReadyAdresses"] = document["spec"].pop("publishNotReadyAddresses")
    with pytest.raises(AssertionError, match="not recognised"):
        model(document)


def test_the_manifests_fit_together():
    docs = manifests()
    service, job = model(docs["service"]), model(docs["job"])
    pod = job.spec.template
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses
    assert all(pod.metadata.labels.get(k) == v for k, v in service.spec.selector.items())
    assert {(p.port, p.protocol) for p in service.spec.ports} == {(7946, "UDP"), (7946, "TCP")}
    (worker,) = pod.spec.containers
    command = [c.replace("$(POD_IP)", "10.1.2.3").replace("$(POD_NAMESPACE)", "default") for c in worker.command]
    assert command[:2] == ["ftcomm", "run"]
    args = build_parser().parse_args(command[1:])
    host, port, dns = parse_seed(args.peers)
    assert dns and host == f"{service.metadata.name}.default.svc.cluster.local" and port == args.port == 7946
    assert args.bind == "10.1.2.3" and args.command[0] == "train.py"
    assert pod.spec.termination_grace_period_seconds > args.stop_timeout
    env = {e.name: e for e in worker.env}
    assert env["FTCOMM_SECRET"].value_from.secret_key_ref.name == "ftcomm-job"
    assert env["POD_IP"].value_from.field_ref.field_path == "status.podIP"
    assert "ftcomm members" in " ".join(worker.readiness_probe._exec.command)
