"""`inflight check` against the real dev stack: passes on a correct config; each broken
setting fails its own check, names that setting, and leaves the other checks passing."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import msgspec
import pytest
import yaml

from tests.conftest import arch_checkpoint
from tests.integration.conftest import ROOT, worker_config
from worker.cli.preflight import Check, exit_code, render, run_preflight

ALL = ["kafka", "topics", "consumer group", "redis", "redis persistence", "model", "limits", "kv cache", "compile",
       "metrics port"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free again once closed: nothing listens there


@pytest.fixture
def good(services, prefix, llama_path):
    return worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"})


def by_name(checks: list[Check]) -> dict[str, Check]:
    assert [c.name for c in checks] == ALL
    return {c.name: c for c in checks}


def only_failure(checks: list[Check], name: str, setting: str) -> Check:
    """The one failed check is `name`, naming `setting`; everything else passed, reported or
    was skipped because it depends on the failed one."""
    failed = [c for c in checks if c.status == "fail"]
    assert [(c.name, c.setting) for c in failed] == [(name, setting)], render(checks)
    assert exit_code(checks) == 1
    assert f"FAIL  {name}" in render(checks) and setting in render(checks).splitlines()[ALL.index(name)]
    return failed[0]


def group_members(bootstrap: str, group_id: str) -> tuple[str, int]:
    from aiokafka.admin import AIOKafkaAdminClient

    async def describe():
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            g = (await admin.describe_consumer_groups([group_id]))[0].to_object()["groups"][0]
            return g["state"], len(g["members"])
        finally:
            await admin.close()

    return asyncio.run(describe())


def test_a_correct_config_passes_without_joining_the_group(good, services, prefix):
    checks = run_preflight(good)
    c = by_name(checks)
    assert [x.name for x in checks if x.status != "pass"] == ["redis persistence", "compile"], render(checks)
    assert c["redis persistence"].status == "info"
    assert c["compile"].detail.startswith("eager (model.compile")  # the suite's engines run eagerly (conftest)
    assert "appendonly no" in c["redis persistence"].detail  # the dev stack runs Redis without persistence
    assert f"{prefix}.jobs.high 3" in c["topics"].detail and f"{prefix}.dlq 3" in c["topics"].detail
    assert "chat template present" in c["model"].detail
    assert "supported (full causal attention); load check: logits within" in c["model"].detail
    assert "4096 tokens" in c["kv cache"].detail
    # limits follow the 1024-token context of the tiny model when unset (issue 32)
    assert c["limits"].detail == ("max_input_tokens 1023 (from the context of 1024), max_output_tokens 256 (set)")
    assert exit_code(checks) == 0 and render(checks).endswith("all 8 checks passed")
    # described and its offsets fetched, never joined: no member, no rebalance for running workers
    assert group_members(services[0], good.kafka.group_id) == ("Dead", 0)


def test_wrong_kafka_port(good):
    cfg = msgspec.structs.replace(good, kafka=msgspec.structs.replace(
        good.kafka, bootstrap_servers=f"127.0.0.1:{closed_port()}"))
    checks = run_preflight(cfg, timeout_s=5)
    fail = only_failure(checks, "kafka", "kafka.bootstrap_servers")
    assert cfg.kafka.bootstrap_servers in fail.detail and "cannot connect" in fail.detail
    c = by_name(checks)
    assert c["topics"].status == c["consumer group"].status == "skip"
    assert c["redis"].status == c["model"].status == "pass"


def test_missing_topics(good):
    cfg = msgspec.structs.replace(good, kafka=msgspec.structs.replace(good.kafka, topic_prefix="never-created-x1"))
    fail = only_failure(run_preflight(cfg), "topics", "kafka.topic_prefix")
    for t in ("jobs.high", "jobs.normal", "jobs.low", "cancel", "dlq"):
        assert f"never-created-x1.{t}" in fail.detail
    assert "inflight topics create" in fail.detail


def test_redis_down(good):
    cfg = msgspec.structs.replace(good, redis=msgspec.structs.replace(
        good.redis, url=f"redis://:pw-not-shown@127.0.0.1:{closed_port()}/0"))
    checks = run_preflight(cfg, timeout_s=5)
    fail = only_failure(checks, "redis", "redis.url")
    assert "connecting" in fail.detail and "pw-not-shown" not in render(checks)
    assert render(checks).endswith("1 of 8 checks failed: redis")  # the persistence report is not a check
    assert by_name(checks)["redis persistence"].status == "skip"


def test_bad_model_path(good, tmp_path):
    cfg = msgspec.structs.replace(good, model=msgspec.structs.replace(good.model, path=str(tmp_path / "no-model")))
    checks = run_preflight(cfg)
    fail = only_failure(checks, "model", "model.path")
    assert "no-model" in fail.detail and "config.json" in fail.detail
    assert by_name(checks)["kv cache"].status == "skip"


def test_an_architecture_the_engine_cannot_reproduce_fails_the_model_check(good):
    """Refused at load with the loader's one line (architecture, feature, config field)."""
    path = arch_checkpoint("DeepSeek-V3.2")
    cfg = msgspec.structs.replace(good, model=msgspec.structs.replace(good.model, path=str(path)))
    fail = only_failure(run_preflight(cfg), "model", "model.path")
    assert "model 'deepseek_v32' has indexed_attention layers (config.layer_types[0]); not supported" in fail.detail


@pytest.mark.parametrize("engine_process", [True, False])
def test_the_worker_refuses_it_at_start_with_exit_2(good, tmp_path, engine_process):
    from tests.integration.processes import spawn_worker

    path = arch_checkpoint("DeepSeek-V3.2")
    cfg = msgspec.structs.replace(good, model=msgspec.structs.replace(good.model, path=str(path)),
                                  worker=msgspec.structs.replace(good.worker, engine_process=engine_process))
    proc, log = spawn_worker(tmp_path, cfg, f"refusing-{engine_process}")
    assert proc.wait(timeout=180) == 2, log.read_text()[-2000:]
    text = log.read_text()
    assert "model 'deepseek_v32' has indexed_attention layers (config.layer_types[0]); not supported" in text
    assert "worker started" not in text


def test_an_unsupported_quantization_fails_the_model_check_and_the_worker_exits_2(good, tmp_path):
    """A bitsandbytes checkpoint (not served) is refused like an architecture: the model
    check's FAIL line names the method and the field, and the worker exits 2 with it."""
    import json
    import shutil

    from tests.integration.processes import spawn_worker

    path = tmp_path / "bnb"
    shutil.copytree(good.model.path, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    cfg = msgspec.structs.replace(good, model=msgspec.structs.replace(good.model, path=str(path)))
    line = ("model 'llama' has weights quantized with 'bitsandbytes' (config.quantization_config.quant_method); "
            "not supported")
    assert line in only_failure(run_preflight(cfg), "model", "model.path").detail
    proc, log = spawn_worker(tmp_path, cfg, "bnb")
    assert proc.wait(timeout=180) == 2, log.read_text()[-2000:]
    assert line in log.read_text() and "worker started" not in log.read_text()


def test_a_quantized_checkpoint_passes_and_the_check_names_its_scheme(good, tmp_path):
    from tools.make_quantized import make_quantized

    path = make_quantized(good.model.path, tmp_path / "w8a8", "w8a8")
    cfg = msgspec.structs.replace(good, model=msgspec.structs.replace(good.model, path=str(path)))
    checks = run_preflight(cfg)
    assert exit_code(checks) == 0, render(checks)
    assert ("compressed-tensors W8A8 (int8 weights, per-channel scales, symmetric, int8 activations per token) "
            "on 14 layers") in by_name(checks)["model"].detail


def test_a_limit_above_the_model_context_fails_naming_both_numbers(good):
    tuning = msgspec.structs.replace(good.serving_tuning, max_input_tokens=8192)
    fail = only_failure(run_preflight(msgspec.structs.replace(good, serving_tuning=tuning)),
                        "limits", "serving_tuning.max_input_tokens")
    assert "8192" in fail.detail and "context of 1024" in fail.detail and "unset it to use 1023" in fail.detail


def test_kv_cache_larger_than_memory(good):
    # tiny Llama: 2 layers x 2 KV heads x head_dim 16 x K and V x 4 B = 512 B per token; 2**40 tokens = 512 TiB
    tuning = msgspec.structs.replace(good.serving_tuning, max_total_tokens=2**40)
    fail = only_failure(run_preflight(msgspec.structs.replace(good, serving_tuning=tuning)),
                        "kv cache", "serving_tuning.max_total_tokens")
    assert f"{2**40} tokens" in fail.detail and "512 B/token" in fail.detail and "available RAM" in fail.detail
    assert " > " in fail.detail and "tokens fit" in fail.detail


def test_metrics_port_in_use(good):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = msgspec.structs.replace(good, metrics=msgspec.structs.replace(good.metrics, port=port))
        fail = only_failure(run_preflight(cfg), "metrics port", "metrics.port")
    assert str(port) in fail.detail


def test_cli_exit_codes_and_lines(good, tmp_path):
    """`inflight check --config FILE`: 0 and a PASS line per check on a good file; 1 and the
    setting named on a bad one; 2 on a config error."""
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(msgspec.to_builtins(good)))
    cmd = [sys.executable, "-m", "worker", "check", "--config", str(path)]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:-1]] == ["PASS"] * 4 + ["INFO"] + ["PASS"] * 3 + ["INFO", "PASS"]
    assert lines[-1] == "all 8 checks passed"
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**_env(), "INFLIGHT_KAFKA__TOPIC_PREFIX": "never-created-x2"})
    assert bad.returncode == 1
    assert any(ln.startswith("FAIL") and "kafka.topic_prefix" in ln for ln in bad.stdout.splitlines())
    wrong = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**_env(), "INFLIGHT_SERVING_TUNING__KV_POLICY": "greedy"})
    assert wrong.returncode == 2 and "serving_tuning.kv_policy" in wrong.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHT_")} | {"PYTHONPATH": str(ROOT)}


def test_a_pool_bound_above_what_the_worker_can_run_fails_the_limits_check(good, services, prefix):
    """The worker refuses to start when its pool serves longer prompts than its
    `max_input_tokens`; the preflight (the Kubernetes initContainer) must fail there too."""
    from schemas.pools import Pool, Pools
    from worker.cli.topics import create_topics

    pools = [Pool(name="default", max_prompt_tokens=256), Pool(name="long", max_prompt_tokens=5000)]
    asyncio.run(create_topics(services[0], prefix, partitions=3, pools=Pools(pools)))
    cfg = msgspec.structs.replace(good, pools=pools, worker=msgspec.structs.replace(good.worker, pool="long"))
    fail = only_failure(run_preflight(cfg), "limits", "pools")
    assert "pool 'long' serves prompts up to 5000 tokens" in fail.detail
    assert "the model's context (1024 tokens) cannot hold such prompts" in fail.detail
