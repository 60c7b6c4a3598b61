"""The deployment run for real in containers (podman + runc): started by
tools/deploy_check.sh, which builds the images first and sets INFLIGHT_DEPLOY_CHECK=1;
skipped in a plain pytest run.

One Compose stack (deploy/compose.yaml + deploy/compose.local.yaml) per session, brought
up in dependency order by hand (podman before 4.6 ignores `condition: service_healthy`),
taken down with its volumes at the end. Every container shares the host's network, so
the host reaches Kafka on localhost:19192, Redis on 6379, the worker's metrics on 8000,
the gateway on 8080 and Prometheus on 9090.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "deploy"
PROJECT = "inflight"
KAFKA = "localhost:19192"
REDIS = "redis://127.0.0.1:6379/0"
WORKER_HTTP = "http://127.0.0.1:8000"
GATEWAY = "http://127.0.0.1:8080"
PROMETHEUS = "http://127.0.0.1:9090"
API_KEY = "sk-local-dev-key"  # deploy/compose.yaml's gateway key

ENABLED = os.environ.get("INFLIGHT_DEPLOY_CHECK") == "1"


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="containers: run tools/deploy_check.sh (builds the images, sets INFLIGHT_DEPLOY_CHECK=1)")
    for item in items:
        if "tests/deploy/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def run(*cmd: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run a command, text output captured; on `check`, a failure shows its output."""
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


DRAIN_TIMEOUT_S = 2  # the worker's drain here (compose.local.yaml): a stop hands running jobs back


def compose(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = os.environ.get("PODMAN_COMPOSE", "podman-compose")
    files = ["-f", str(ROOT / "deploy" / "compose.yaml"), "-f", str(ROOT / "deploy" / "compose.local.yaml")]
    env = {**os.environ, "INFLIGHT_LOCAL_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S)}
    return run(exe, *files, *args, check=check, timeout=timeout, env=env)


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return run("podman", *args, check=check, timeout=timeout)


def exit_code(name: str) -> int:
    return int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())


def running(name: str) -> bool:
    return podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true"


def http_get(url: str, timeout: float = 3) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, probe, timeout: float, every: float = 1.0, logs_of: str | None = None):
    """Poll `probe()` until it returns a truthy value; on timeout, or as soon as the
    container `logs_of` is no longer running, fail with that container's log. An
    AssertionError from the probe fails at once; any other exception is retried."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if logs_of and not running(logs_of):
            last = f"container {logs_of} exited ({exit_code(logs_of)})"
            break
        try:
            last = probe()
            if last:
                return last
        except AssertionError:  # a probe's verdict that waiting cannot change
            raise
        except Exception as e:  # noqa: BLE001 - a probe of a service still starting fails in many ways
            last = e
        time.sleep(every)
    log = ""
    if logs_of:
        p = podman("logs", "--tail", "60", logs_of, check=False)
        log = p.stdout + p.stderr
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})\n{log}")


def healthy(name: str) -> bool:
    """The image's own health check, run on demand (no systemd timer runs it here)."""
    return podman("healthcheck", "run", name, check=False, timeout=60).returncode == 0


def record(key: str, value) -> None:
    """Numbers for the README: .cache/deploy/timings.json."""
    path = CACHE / "timings.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def stack():
    """The Compose stack up and serving; down (volumes too) at the end."""
    compose("down", "-v", "-t", "5", check=False, timeout=180)
    t0 = time.monotonic()
    compose("up", "-d", "--no-build", "kafka", "redis")
    wait_for("kafka healthy", lambda: healthy(container("kafka")), 120, 2, logs_of=container("kafka"))
    wait_for("redis healthy", lambda: healthy(container("redis")), 30, logs_of=container("redis"))
    compose("up", "-d", "--no-build", "--no-deps", "topics")
    assert podman("wait", container("topics"), timeout=120).stdout.strip() == "0", podman("logs", container("topics")).stderr
    # `inflight check` in the worker's image, config and volumes, before the worker holds its port
    preflight = compose("run", "--rm", "--no-deps", "--entrypoint", "inflight", "worker",
                        "check", "--config", "/etc/inflight/config.yaml", check=False, timeout=300)
    compose("up", "-d", "--no-build", "--no-deps", "worker", "gateway", "prometheus")
    wait_for("worker ready", lambda: http_get(WORKER_HTTP + "/readyz")[0] == 200, 240, logs_of=container("worker"))
    wait_for("gateway healthy", lambda: http_get(GATEWAY + "/healthz")[0] == 200, 60, logs_of=container("gateway"))
    yield {"t0": t0, "preflight": preflight}
    if os.environ.get("INFLIGHT_DEPLOY_KEEP") != "1":
        compose("down", "-v", "-t", "10", check=False, timeout=300)
