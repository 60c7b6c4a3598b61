"""The demo's flow (`tools/demo.py`) on the test model: what it prints is what happened.
Issue 32: its cancel used to race the job's EOS and it claimed the blocks freed anyway."""

from __future__ import annotations

import re

from tools import demo


def test_the_demo_cancels_its_victim_and_reports_what_it_read(services, prefix, llama_path, capsys):
    assert demo.main(["--model", str(llama_path), "--kafka", services[0], "--redis", services[1],
                      "--prefix", prefix, "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    victim = re.search(r"cancelling (\S+) after 6 token events; it holds (\d+) KV block", out)
    assert victim and int(victim.group(2)) > 0, out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{victim.group(1)}: finished"))
    assert "(cancelled," in line and "block table is now [] (its KV blocks are free)" in line, line
    assert re.search(r"request_abort_total\{cancelled\} 1\b", out), out
    assert re.search(r"KV cache now: 0 used", out), out
