"""The worker's front process (Kafka, Redis, claims, streaming) and the gateway do not
import torch: their engine process does. Importing torch, transformers' torch side and
their native libraries costs seconds and hundreds of MB per process; a fleet starts
these processes far more often than it loads a model (and the tests start dozens)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
from worker.config import WorkerConfig
from worker.serve.worker import Worker
import worker.__main__, worker.gateway.app
Worker(WorkerConfig())  # builds its metrics, intake, claims, starter: nothing started
print(sorted(m for m in ("torch", "transformers.modeling_utils", "triton") if m in sys.modules))
"""


def test_the_front_process_and_the_gateway_import_no_torch():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_gpus_hidden_from_the_process_are_no_gpu_for_the_metrics(monkeypatch):
    """`nvml_available` asks NVML (not torch), and like torch counts no GPU when
    `CUDA_VISIBLE_DEVICES` hides them all."""
    from worker.serve.health import nvml_available

    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert nvml_available() is False
