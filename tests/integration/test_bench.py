"""The benchmarks run end to end on very small workloads and write self-consistent
result files (numbers are not asserted: speed is for the benchmarks, not tests)."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest

from tools.bench import e2e as bench_e2e
from tools.bench import engine as bench_engine


def ordered(p: dict | None) -> None:
    assert p is not None
    assert 0 <= p["p50"] <= p["p95"] <= p["p99"], p


def opens(path) -> None:
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100


def test_engine_modes_write_consistent_results(tmp_path, llama_path):
    assert bench_engine.main(["--out", str(tmp_path), "throughput", "--model", str(llama_path), "--num-requests", "6",
                              "--max-batch", "4", "--budget", "64", "--max-input", "64", "--max-output", "32",
                              "--device", "cpu", "--vllm-python", str(tmp_path / "no-vllm" / "python")]) == 0
    r = json.loads((tmp_path / "bench_engine_throughput.json").read_text())
    total = sum(x["output_tokens"] for x in r["requests"])
    assert total == r["workload"]["output_tokens"] and len(r["requests"]) == 6
    assert sum(x["input_tokens"] for x in r["requests"]) == r["workload"]["input_tokens"]
    others = {"inflight_async", "inflight_eager", "hf_static_batching", "hf_continuous_batching"}  # the CPU's defaults
    assert set(r["results"]) == {"inflight"} | others
    assert set(r["skipped"]) == {"vllm"} and "tools/setup_vllm.sh" in r["skipped"]["vllm"]  # absent: a message
    for res in r["results"].values():
        assert res["output_tokens"] == total
        assert res["output_tokens_per_s"] == pytest.approx(total / res["seconds"])
    assert set(r["greedy_agreement"]) == {f"inflight_vs_{n}" for n in others}
    # asynchronous and sequential (the CPU's default) steps: the same greedy ids on every request
    assert r["greedy_agreement"]["inflight_vs_inflight_async"] == {
        "requests": 6, "identical": 6, "median_first_divergence": None}
    # the default forward (here eager: tests/conftest.py turns `auto` off) and `model.compile: off`
    assert r["greedy_agreement"]["inflight_vs_inflight_eager"] == {
        "requests": 6, "identical": 6, "median_first_divergence": None}
    for name in others:
        assert r["ratios"][f"inflight_vs_{name}"] == pytest.approx(
            r["results"]["inflight"]["output_tokens_per_s"] / r["results"][name]["output_tokens_per_s"])
    assert {x["shape"] for x in r["requests"]} <= {"sharegpt", "alpaca", "long_prompt"}
    opens(tmp_path / "bench_engine_throughput.png")

    assert bench_engine.main(["--out", str(tmp_path), "scheduler", "--running", "8", "16", "--steps", "5"]) == 0
    s = json.loads((tmp_path / "bench_engine_scheduler.json").read_text())
    assert [row["running_requests"] for row in s["rows"]] == [8, 16]
    for row in s["rows"]:
        assert 0 < row["schedule_ms"] <= row["scheduler_plus_bookkeeping_ms"]
        assert row["metrics_per_step_ms"] > 0
    assert [p["scenario"] for p in s["kv_pressure"]] == list(bench_engine.KV_PRESSURE)
    for p in s["kv_pressure"]:
        assert p["prefill_tokens_computed"] >= p["prefill_tokens_needed"] > 0
        assert p["recompute_ratio"] == pytest.approx(p["prefill_tokens_computed"] / p["prefill_tokens_needed"])
        assert 0 <= p["max_preemptions_per_request"] <= p["preemptions"]


def test_speculative_decoding_bench_writes_consistent_results(tmp_path, llama_path):
    from tests.conftest import draft_checkpoint
    from tools.bench import spec as bench_spec

    assert bench_spec.main(["--model", str(llama_path), "--running", "1", "2", "--methods", "ngram:2", "suffix:2",
                            "draft:2", "--draft-model", str(draft_checkpoint("llama")), "--rounds", "2",
                            "--max-tokens", "12", "--saturation", "3", "--compile", "off", "--min-speedup", "none",
                            "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench_spec.json").read_text())
    assert set(r["by_workload"]) == {"prompt", "repeat"} and r["min_speedup"] is None
    for by_running in list(r["by_workload"].values()) + [r["saturation"]]:
        for rows in by_running.values():
            assert set(rows) >= {"off", "ngram:2"}
            assert rows["off"]["tpot_ratio_vs_off"] == 1.0 and rows["off"]["throughput_ratio_vs_off"] == 1.0
            assert rows["off"]["wall_ratio_vs_off"] == 1.0
            for name, row in rows.items():
                assert row["tpot_ms"] > 0 and row["output_tokens_per_s"] > 0, name
                if row.get("drafts"):
                    assert 0 <= row["acceptance_rate"] <= 1 and 1 <= row["mean_accepted_length"] <= 3
    opens(tmp_path / "bench_spec.png")


def test_redis_log_bench_writes_consistent_results(tmp_path, services):
    from tools.bench import redis_log

    assert redis_log.main(["--redis", services[1], "--jobs", "3", "--tokens", "40", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench_redis_log.json").read_text())
    off, on = r["configs"]
    assert (off["compact_logs"], on["compact_logs"]) == (False, True)
    assert off["replay_identical"] and on["replay_identical"]  # read_log gave the same events both ways
    assert on["entries_per_log_ended"] == 3 and off["entries_per_log_ended"] > 40  # started, one run, finished
    assert r["ended_on_vs_off"] == round(on["bytes_ended"] / off["bytes_ended"], 3) < 1
    assert on["bytes_per_1k_tokens_ended"] == round(on["bytes_ended"] / 120 * 1000)
    opens(tmp_path / "bench_redis_log.png")


@pytest.mark.parametrize("consumer,rates", [("stream", ["3", "8"]), ("result", ["5"])])
def test_e2e_sweep_writes_consistent_results(tmp_path, llama_path, services, consumer, rates):
    argv = ["--out", str(tmp_path), "--kafka", services[0], "--redis", services[1], "--model", str(llama_path),
            "--device", "cpu", "--rates", *rates, "--requests-per-rate", "6", "--baseline-requests", "6",
            "--max-batch", "4", "--budget", "64", "--max-input", "64", "--max-output", "24", "--consumer", consumer]
    assert bench_e2e.main(argv) == 0
    r = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert r["mode"] == "e2e" and [row["offered_rate"] for row in r["rates"]] == [float(x) for x in rates]
    for row in r["rates"]:
        reqs = row["requests"]
        assert len(reqs) == row["num_requests"] == 6
        assert sum(row["finish_reasons"].values()) == 6
        assert row["completed"] == sum(1 for q in reqs if q["finish_reason"] in ("stop", "length")) == 6
        assert row["output_tokens"] == sum(q["output_tokens"] for q in reqs)
        for q in reqs:  # EOS ignored: every request delivers exactly what it asked for
            assert q["output_tokens"] == q["requested_tokens"]
            assert q["submit_s"] <= q["finish_s"]
            if consumer == "stream":
                assert q["submit_s"] <= q["first_token_s"] <= q["finish_s"]
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["duration_s"])
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            ordered(row[key])
        assert row["e2e_s"]["p50"] >= row["ttft_s"]["p50"] or consumer == "result"
        tl = row["timeline"]["rows"]
        assert tl and all(0 <= x[1] <= 1 for x in tl)
        assert [x[0] for x in tl] == sorted(x[0] for x in tl)
        assert row["rejections"] == 0
    sustainable = [row for row in r["rates"] if row["sustainable"]]
    if sustainable:
        assert r["max_sustainable"]["output_tokens_per_s"] == max(x["output_tokens_per_s"] for x in sustainable)
    assert r["peak"]["output_tokens_per_s"] == max(x["output_tokens_per_s"] for x in r["rates"])
    ea = r["engine_alone"]
    assert ea["output_tokens_per_s"] == pytest.approx(ea["output_tokens"] / ea["seconds"])
    opens(tmp_path / "bench_e2e_latency_throughput.png")
    opens(tmp_path / "bench_e2e_timeline.png")


def test_greedy_agreement_counts_identical_requests_and_the_first_divergence():
    ref = {"a": [1, 2, 3], "b": [1, 2, 3], "c": [4, 5, 6], "d": [7, 8]}
    other = {"a": [1, 2, 3], "b": [1, 9, 3], "c": [0, 5, 6], "d": [7]}
    assert bench_engine.agreement(ref, other) == {"requests": 4, "identical": 1, "median_first_divergence": 1}


def test_host_bench_measures_each_case_in_this_tree(tmp_path, monkeypatch):
    """`tools.bench.host` without a baseline: every case measured (positive ms), written
    as JSON and a plot (the engine-alone rows shrunk to a few steps)."""
    from tools.bench import host, pipeline

    real = pipeline.engine_alone
    monkeypatch.setattr(host, "CORE_CASES", [(4, 64, False), (4, 64, True)])
    monkeypatch.setattr(pipeline, "engine_alone", lambda d, n, jobs, running, a=False: real(d, n, 64, running, a))
    monkeypatch.setattr(host, "_measure_in", lambda tree: host.measure())
    assert host.main(["--rounds", "1", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench_host.json").read_text())
    cases = r["median"]["this tree"]
    assert "core, 4-token jobs, async, the null runner's launch excluded" in cases
    assert len(cases) == 2 + 1 + 2 + 3 and all(v > 0 for v in cases.values())
    opens(tmp_path / "bench_host.png")
