"""The engine's thread budget (worker/engine/threads.py): the sizing rule, the cgroup
quota, the host-wide engine registry (live and dead entries), and a budget following
engines that start and stop."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from worker.engine import threads
from worker.engine.threads import EngineRegistry, ThreadBudget, cgroup_cpu_limit, plan_threads


def test_the_rule_leaves_the_front_end_a_core_and_shares_the_rest():
    assert plan_threads(2, 1, own_process=True) == 1  # the measured case: 2 cores, engine + its worker
    assert plan_threads(2, 2, own_process=True) == 1  # never 0
    assert plan_threads(16, 1, own_process=True) == 15
    assert plan_threads(16, 2, own_process=True) == 7  # (16 - 2 front ends) // 2
    assert plan_threads(16, 4, own_process=False) == 4  # engine in the worker's thread: no reserve
    assert plan_threads(1, 1, own_process=True) == 1
    assert plan_threads(16, 4, own_process=True, setting=6) == 6  # worker.engine_threads wins


def test_cgroup_quota_v2_v1_and_unlimited(tmp_path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 1.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None


def test_usable_cpus_is_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 2.5)
    assert threads.usable_cpus() == 2
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 0.5)
    assert threads.usable_cpus() == 1
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    assert threads.usable_cpus() == 8


HOLDER = """
import sys, time
from worker.engine.threads import EngineRegistry
r = EngineRegistry(sys.argv[1]); r.register(); print("ready", flush=True)
time.sleep(60)
"""


def test_registry_counts_live_engines_and_drops_dead_ones(tmp_path):
    me = EngineRegistry(tmp_path)
    me.register()
    assert me.count() == 1
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        assert me.count() == 2
        other.kill()  # a crash: no cleanup, the lock goes with the process
        other.wait(10)
        assert me.count() == 1
        assert len(list(tmp_path.glob("engine-*.lock"))) == 1  # the dead one's file is gone
    finally:
        other.kill()
        me.close()
    assert not list(tmp_path.glob("engine-*.lock"))
    assert EngineRegistry(tmp_path).count() == 1  # unregistered: counts only itself


def test_budget_follows_engines_that_come_and_go(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "usable_cpus", lambda: 9)
    budget = ThreadBudget(own_process=True, registry=EngineRegistry(tmp_path))
    try:
        assert budget.start() == 8 and torch.get_num_threads() == 8
        second = EngineRegistry(tmp_path)
        second.register()
        budget.recheck()  # too soon: unchanged
        assert budget.threads == 8
        budget.recheck(now=time.monotonic() + threads.RECHECK_S + 1)
        assert budget.threads == 3 and budget.engines == 2 and torch.get_num_threads() == 3  # (9 - 2) // 2
        second.close()
        budget.recheck(now=time.monotonic() + threads.RECHECK_S + 1)
        assert budget.threads == 8
        fixed = ThreadBudget(own_process=True, setting=2, registry=EngineRegistry(tmp_path / "b"))
        assert fixed.start() == 2 and torch.get_num_threads() == 2
        fixed.close()
    finally:
        budget.close()
        torch.set_num_threads(before)
