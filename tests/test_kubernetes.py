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
KINDS = {"Service": "V1Service", "Job": "V1Job", "PersistentVolumeClaim": "V1PersistentVolumeClaim"}


def model(document: dict):
    api = kubernetes.client.ApiClient()
    built = api._ApiClient__deserialize(document, KINDS[document["kind"]])
    assert api.sanitize_for_serialization(built) == document, "a field was not recognised by the model"
    return built


def manifests() -> dict[str, dict]:
    return {path.stem: yaml.safe_load(path.read_text()) for path in sorted(EXAMPLE.glob("*.yaml"))}


def test_every_manifest_is_a_valid_object_of_its_kind():
    docs = manifests()
    assert set(docs) == {"service", "job", "pvc"}
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
    # Flash checkpoints need a memory-backed /dev/shm (containers get 64 MiB), persisted
    # copies a volume every pod shares, and evictions must not use up the failure budget.
    volumes = {v.name: v for v in pod.spec.volumes}
    mounts = {m.mount_path: m.name for m in worker.volume_mounts}
    assert volumes[mounts["/dev/shm"]].empty_dir.medium == "Memory"
    claim = volumes[mounts["/checkpoints"]].persistent_volume_claim.claim_name
    assert claim == model(docs["pvc"]).metadata.name and "ReadWriteMany" in model(docs["pvc"]).spec.access_modes
    assert args.checkpoint_dir.startswith("/checkpoints/") and args.save_at_breakpoint
    rules = job.spec.pod_failure_policy.rules
    assert any(r.action == "Ignore" and r.on_pod_conditions[0].type == "DisruptionTarget" for r in rules)
    assert worker.liveness_probe is not None and worker.resources.limits["memory"]


def test_the_probe_command_of_the_manifest_answers_for_a_live_worker(monkeypatch):
    """The readiness probe's command line, run as the pod runs it (``sh -c`` with $POD_IP
    and the group's secret in the environment), against a live worker of the cluster
    ftcomm-job on this host."""
    import os
    import subprocess

    import ftcomm
    from tests.conftest import free_port

    (worker,) = model(manifests()["job"]).spec.template.spec.containers
    probe = worker.readiness_probe._exec.command
    assert probe[:2] == ["sh", "-c"] and ":7946" in probe[2]
    port = free_port()
    group = ftcomm.init(bind=f"127.0.0.1:{port}", cluster="ftcomm-job", secret="pod-secret", handle_signals=False)
    try:
        env = {**os.environ, "POD_IP": "127.0.0.1", "FTCOMM_SECRET": "pod-secret"}
        command = [probe[0], probe[1], probe[2].replace(":7946", f":{port}")]
        assert subprocess.run(command, env=env, timeout=60).returncode == 0
        wrong = {**env, "FTCOMM_SECRET": "another"}
        assert subprocess.run(command, env=wrong, timeout=60, capture_output=True).returncode != 0
    finally:
        group.shutdown()
