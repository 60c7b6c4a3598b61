"""Every test that waits for a worker to start waits `tests.integration.helpers.START_S`.

A worker's start (an engine process importing torch and transformers, a checkpoint
loaded, a consumer group joined) is the one wait in the suite whose length depends on
how busy the box is: 5-10 s alone, over 60 s beside two other pytest-xdist workers. A
bound picked per test (30 s, 90 s, 120 s were) fails at random in CI; the rule is one
bound for a start that never ends, not a measure of speed (a CI run failed on
test_tracing's 30 s)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the helpers that wait for a start, and the position of their bound when passed positionally
START_WAITS = {"start_worker": 2, "running_worker": 2, "wait_started": 2}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def own_bounds(source: str) -> list[int]:
    """The lines of `source` where a start wait is called with a bound of its own."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (name := _name(node.func)) in START_WAITS and (
                any(k.arg == "timeout" for k in node.keywords) or len(node.args) > START_WAITS[name]):
            lines.append(node.lineno)
    return lines


def test_every_start_wait_uses_the_one_bound():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for line in own_bounds(p.read_text())]
    assert not found, found


def test_the_scan_sees_a_bound_of_its_own():
    code = ("async def t():\n"
            "    await start_worker(cfg, None)\n"
            "    await start_worker(cfg, None, timeout=30)\n"
            "    async with helpers.running_worker(cfg, engine, timeout=90):\n"
            "        await wait_started(log, p, 90)\n")
    assert own_bounds(code) == [3, 4, 5]
