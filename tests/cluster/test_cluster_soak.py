"""The cluster soak's short form: `python -m tools.soak --cluster --minutes 4`, every fault
kind once (leader, coordinator and controller kills, a rolling restart, a paused broker, a
Sentinel failover, a worker stopped past its leases, a worker killed) over a mix of jobs,
and every job audited: no defect of any kind. About 9 minutes (the 30-minute run and its
figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.soak_faults import CLUSTER_FAULTS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]


def test_a_short_cluster_soak_finds_no_defect(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.soak", "--cluster", "--minutes", "4", "--rate", "4",
                          "--settle-s", "300", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1400)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    injected = {f["fault"] for f in report["faults"] if "fault" in f}
    assert injected >= {*CLUSTER_FAULTS, "sigstop", "kill9"}, injected
    assert report["jobs"] > 500
    assert all(n == 0 for n in report["defects"].values()), (report["defects"], report.get("defect_logs"))
