"""deploy/k8s's worker pod under `podman kube play`: the ConfigMap, the Deployment (with
its `preflight` init container) and the example Secret, as users apply them, with only
what a laptop lacks changed:

- the image: the locally built localhost/inflight-worker:latest;
- the GPU: `nvidia.com/gpu` requests and the GPU toleration dropped, the model on the CPU;
- the models PersistentVolumeClaim: a hostPath to the tiny checkpoint;
- the network: the pod on the host's (hostNetwork), Kafka and Redis those of the Compose
  stack (plaintext, no SASL), so the probes' port 8000 is the host's; podman 4.3 refuses
  `ports` on the host's network ("PortMappings can only be used with Bridge or
  slirp4netns networking"), so the container's named port is dropped and the probes get
  its number (the test checks that the names resolve to the configured metrics port first);
- the restart policy: OnFailure (a Deployment's is Always): podman 4.3 applies it to init
  containers too, restarts the preflight after it passed, then fails to remove it ("failed
  to remove once init container ... it is running"); Kubernetes never restarts an init
  container that succeeded, and retries one that failed, which OnFailure gives here;
- the Secret: as the API server stores it (`stringData` base64-encoded into `data`), and
  given to podman as a podman secret of that name holding the `data` map in JSON, which is
  where podman's `secretKeyRef` looks.

What podman cannot run (the KEDA ScaledObject, the PodDisruptionBudget, Services) stays
validated by tests/repo/test_deploy.py. Runs after test_compose.py (the stack's Kafka and
Redis), with the Compose worker stopped (it holds port 8000 and the consumer group).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import subprocess

import pytest
import yaml

from schemas.wire import SamplingParams
from tests.deploy.conftest import (
    CACHE,
    KAFKA,
    REDIS,
    ROOT,
    WORKER_HTTP,
    container,
    http_get,
    podman,
    wait_for,
)
from worker.client import InflightClient

K8S = ROOT / "deploy" / "k8s"
IMAGE = "localhost/inflight-worker:latest"
POD = "inflight-worker-pod-0"  # podman kube play's pod for Deployment inflight-worker
PROBES = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def manifests(**config_changes) -> tuple[list[dict], dict]:
    """(ConfigMap + Deployment, the Secret) adapted as the module docstring says;
    `config_changes` are set into config.yaml (dotted paths)."""
    (cm,) = docs("configmap.yaml")
    (dep,) = [d for d in docs("deployment.yaml") if d["kind"] == "Deployment"]
    secret = next(d for d in docs("secret.example.yaml") if d["metadata"]["name"] == "inflight-credentials")
    cm, dep, secret = copy.deepcopy(cm), copy.deepcopy(dep), copy.deepcopy(secret)
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    cfg["kafka"] = {**{k: v for k, v in cfg["kafka"].items() if not k.startswith(("sasl", "security"))},
                    "bootstrap_servers": KAFKA}
    cfg["model"]["device"] = "cpu"
    cfg["serving_tuning"]["max_total_tokens"] = 8192
    for path, value in config_changes.items():
        *parents, leaf = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    cm["data"]["config.yaml"] = yaml.safe_dump(cfg)
    secret["stringData"]["redis-url"] = REDIS
    pod = dep["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    pod["restartPolicy"] = "OnFailure"  # see the module docstring
    pod.pop("tolerations", None)
    for c in pod["initContainers"] + pod["containers"]:
        c["image"] = IMAGE
        c["imagePullPolicy"] = "Never"
        for kind in ("requests", "limits"):
            c["resources"][kind].pop("nvidia.com/gpu", None)
    (worker,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in worker.pop("ports")}
    for probe in PROBES:
        worker[probe]["httpGet"]["port"] = ports[worker[probe]["httpGet"]["port"]]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    models.pop("persistentVolumeClaim")
    models["hostPath"] = {"path": str(CACHE / "models"), "type": "Directory"}
    return [cm, dep], secret


def play(tmp_path, kube: list[dict], secret: dict, wait: bool = True):
    """`podman kube play` the manifests, the Secret first (see the module docstring).
    `wait`: the play's CompletedProcess (it returns once the pod's containers started, or
    failed); else the running play's Popen (a failing init container is restarted, as
    Kubernetes does, for minutes)."""
    f = tmp_path / "worker.yaml"
    f.write_text(yaml.safe_dump_all(kube))
    s = tmp_path / "secret.json"
    s.write_text(json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in secret["stringData"].items()}))
    podman("secret", "rm", secret["metadata"]["name"], check=False)
    podman("secret", "create", secret["metadata"]["name"], str(s))
    cmd = ["podman", "kube", "play", "--replace", str(f)]
    if wait:
        return podman(*cmd[1:], check=False, timeout=600)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def down(tmp_path) -> None:
    podman("kube", "play", "--down", str(tmp_path / "worker.yaml"), check=False, timeout=180)
    podman("secret", "rm", "inflight-credentials", check=False)


@pytest.fixture(scope="module", autouse=True)
def compose_worker_stopped(stack):
    podman("stop", "-t", "90", container("worker"), check=False, timeout=120)
    yield
    podman("start", container("worker"), check=False)


def test_bad_config_blocks_the_worker_in_its_preflight(tmp_path):
    kube, secret = manifests(**{"kafka.topic_prefix": "no-such-prefix"})
    proc = play(tmp_path, kube, secret, wait=False)
    try:
        def failed():
            if proc.poll():  # the play itself failed: the pod never came up, say why at once
                raise AssertionError(f"podman kube play exited {proc.returncode}: {proc.stdout.read()}")
            logs = podman("logs", f"{POD}-preflight", check=False)
            return "FAIL" in logs.stdout and logs.stdout

        out = wait_for("the preflight's FAIL line", failed, 240, 2)
        assert "no-such-prefix" in out and "1 of 8 checks failed: topics" in out, out[-3000:]
        state = podman("inspect", "--format", "{{.State.Status}}", f"{POD}-worker").stdout.strip()
        assert state in ("created", "configured"), state  # the worker never started
        with pytest.raises(OSError):
            http_get(WORKER_HTTP + "/healthz", timeout=1)
    finally:
        proc.kill()
        proc.wait()
        down(tmp_path)


def test_good_config_passes_the_preflight_and_the_worker_becomes_ready(tmp_path):
    kube, secret = manifests()
    try:
        p = play(tmp_path, kube, secret)
        assert p.returncode == 0, p.stdout + p.stderr
        logs = podman("logs", f"{POD}-preflight", check=False)
        assert "FAIL" not in logs.stdout + logs.stderr
        # the probes as users apply them: named port -> the configured metrics port
        (dep,) = [d for d in docs("deployment.yaml") if d["kind"] == "Deployment"]
        (worker,) = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
        cfg = yaml.safe_load(kube[0]["data"]["config.yaml"])
        for probe, path in PROBES.items():
            get = worker[probe]["httpGet"]
            assert get["path"] == path and ports[get["port"]] == cfg["metrics"]["port"] == 8000
        wait_for("k8s worker ready", lambda: http_get(WORKER_HTTP + "/readyz")[0] == 200, 300,
                 logs_of=f"{POD}-worker")
        assert http_get(WORKER_HTTP + "/healthz")[0] == 200

        async def serve():
            async with InflightClient(KAFKA, REDIS) as client:
                job = await client.submit("A job for the pod:", params=SamplingParams(max_tokens=10, temperature=0))
                return await client.result(job, timeout_s=120)

        r = asyncio.run(serve())
        assert r.finish_reason == "length" and r.usage.completion_tokens == 10
        # the root file system is read-only (securityContext): the worker wrote only to its emptyDirs
        ro = podman("exec", f"{POD}-worker", "sh", "-c", "touch /opt/x 2>&1 || echo read-only", check=False)
        assert "read-only" in ro.stdout.lower() + ro.stderr.lower()
    finally:
        down(tmp_path)
