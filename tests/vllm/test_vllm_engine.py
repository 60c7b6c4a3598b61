"""`model.engine: vllm` behind the worker's engine client (no Kafka, no Redis): vLLM's
`EngineCore` in vLLM's interpreter speaks the same messages as Inflight's core process,
so the client, input processing and detokenization in front of it are the worker's own.

One core process serves the module (a vLLM start costs tens of CPU-seconds); the
checkpoint is a tiny Llama (head_dim 64, as vLLM's CPU attention needs) in float32, so greedy ids must equal Inflight's
engine's exactly."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from schemas.params import SamplingParams
from schemas.wire import FinishReason
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning, WorkerConfig, WorkerSettings
from worker.engine.core_client import EngineCrashed, ProcessEngineClient
from worker.engine.inputs import RequestInput
from worker.engine.vllm_core import engine_args
from worker.engine.vllm_spec import VllmEngine, VllmStart, derived_engine_args

MAX_RUNNING = 2


class Recorder:
    """The client's metrics hook: every step's stats and idle KV snapshot."""

    def __init__(self) -> None:
        self.steps = []
        self.idle = []

    def observe_step(self, s) -> None:
        self.steps.append(s)

    def observe_idle(self, kv, running, waiting, now=None) -> None:
        self.idle.append(kv)


class Driver:
    """A `ProcessEngineClient` on its own event loop thread; tests submit and wait."""

    def __init__(self, client: ProcessEngineClient) -> None:
        self.client = client
        self.loop = asyncio.new_event_loop()
        self.outputs: dict[str, list] = {}
        self.steps_at: dict[str, list[int]] = {}  # request id -> client.num_steps at each output
        self.crash: BaseException | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(client.start(self.loop, self._on_outputs, self._on_crash), self.loop).result(600)

    def _on_outputs(self, outs) -> None:
        with self._changed:
            for o in outs:
                self.outputs.setdefault(o.request_id, []).append(o)
                self.steps_at.setdefault(o.request_id, []).append(self.client.num_steps)
            self._changed.notify_all()

    def _on_crash(self, e) -> None:
        self.crash = e

    def submit(self, *inputs: RequestInput) -> None:
        def go():
            for inp in inputs:
                self.client.submit(self.client.input.process(inp))

        self.loop.call_soon_threadsafe(go)

    def abort(self, rid: str) -> None:
        self.loop.call_soon_threadsafe(self.client.abort, rid)

    def wait(self, pred, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not pred():
                assert self.crash is None, self.crash
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; outputs so far: { {k: len(v) for k, v in self.outputs.items()} }"
                self._changed.wait(min(left, 0.5))

    def finished(self, rid: str) -> bool:
        return bool(self.outputs.get(rid)) and self.outputs[rid][-1].finished

    def stop(self) -> None:
        self.client.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)


def vllm_config(python: str, **vllm_args) -> EngineConfig:
    return EngineConfig(model=ModelConfig(dtype="float32", device="cpu", engine="vllm", vllm_python=python,
                                          vllm_args={"enforce_eager": True, **vllm_args}),
                        serving_tuning=ServingTuning(max_running_requests=MAX_RUNNING, max_total_tokens=4096,
                                                     enable_prefix_caching=False))


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def driver(vllm_llama_path, vllm_python, recorder):
    cfg = vllm_config(vllm_python, max_logprobs=5)  # below ours (20): a limit only vLLM enforces
    d = Driver(ProcessEngineClient(VllmEngine(str(vllm_llama_path), cfg, vllm_python), cfg.serving_tuning, recorder,
                                   log_level="WARNING"))
    yield d
    d.stop()


def greedy(rid: str, prompt: list[int], n: int, **options) -> RequestInput:
    return RequestInput.of(rid, prompt_token_ids=prompt,
                           params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), **options)


PROMPTS = {f"g{i}": [(7 * i + 3 * j) % 500 + 5 for j in range(5 + 3 * i)] for i in range(5)}


def test_greedy_ids_equal_inflights_engine_and_each_request_finishes_once(driver, vllm_llama_path):
    from worker.engine import Engine

    driver.submit(*(greedy(rid, p, 12) for rid, p in PROMPTS.items()))  # 5 requests, 2 run at once
    driver.wait(lambda: all(driver.finished(rid) for rid in PROMPTS))
    ours = Engine.from_pretrained(str(vllm_llama_path), EngineConfig(model=ModelConfig(dtype="float32", device="cpu")))
    expected = ours.generate(list(PROMPTS.values()), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for (rid, _), exp in zip(PROMPTS.items(), expected, strict=True):
        outs = driver.outputs[rid]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert outs[-1].finish_reason == FinishReason.LENGTH
        ids = [t for o in outs for t in o.new_token_ids]
        assert ids == exp.token_ids, rid
        assert outs[-1].usage.completion_tokens == 12 and outs[-1].usage.prompt_tokens == len(PROMPTS[rid])
        assert "".join(o.text for o in outs) == driver.client.tokenizer.decode(ids)  # our detokenizer, in order


def test_prefix_cache_hits_are_reported_in_usage_as_on_our_engine(vllm_llama_path, vllm_python):
    """vLLM's prefix cache (on here): a prompt that repeats one already run reports the
    prompt tokens vLLM's cache served, whole blocks of vLLM's size, in its usage
    (`cached_prompt_tokens`), as our engine reports its own hits; the first reports 0."""
    cfg = vllm_config(vllm_python)
    cfg = EngineConfig(model=cfg.model, serving_tuning=ServingTuning(max_running_requests=MAX_RUNNING,
                                                                     max_total_tokens=4096))
    rec = Recorder()
    d = Driver(ProcessEngineClient(VllmEngine(str(vllm_llama_path), cfg, vllm_python), cfg.serving_tuning, rec,
                                   log_level="WARNING"))
    try:
        prompt = [(13 * j) % 480 + 5 for j in range(300)]
        d.submit(greedy("first", prompt, 2))
        d.wait(lambda: d.finished("first"))
        d.submit(greedy("again", prompt + [7, 8, 9], 2))
        d.wait(lambda: d.finished("again"))
        block_size = rec.steps[-1].kv.block_size
        assert d.outputs["first"][-1].usage.cached_prompt_tokens == 0
        assert d.outputs["again"][-1].usage.cached_prompt_tokens == len(prompt) // block_size * block_size > 0
    finally:
        d.stop()


def test_a_cancel_ends_the_request_and_frees_its_kv_within_two_steps(driver, recorder):
    driver.submit(greedy("long", [5, 6, 7, 8], 900))
    driver.wait(lambda: len(driver.outputs.get("long", [])) >= 3)
    at = driver.client.num_steps
    driver.abort("long")
    driver.wait(lambda: driver.finished("long"))
    last = driver.outputs["long"][-1]
    assert last.finish_reason == FinishReason.CANCELLED
    assert driver.steps_at["long"][-1] - at <= 2  # the cancelled output within two steps of the abort
    assert sum(len(o.new_token_ids) for o in driver.outputs["long"]) < 900
    n = len(recorder.idle)
    deadline = time.monotonic() + 30
    while len(recorder.idle) == n and time.monotonic() < deadline:  # the next idle tick after it
        time.sleep(0.1)
    assert recorder.idle[-1].used_blocks == 0, recorder.idle[-1]
    assert recorder.steps and recorder.steps[-1].kv.total_blocks == driver.client.num_blocks


def test_the_high_priority_request_is_scheduled_first(driver):
    low = [greedy(f"low{i}", [9, 10, 11 + i], 6, priority="low") for i in range(3)]
    driver.submit(*low, greedy("high", [9, 10, 20], 6, priority="high"))  # one AddRequests: one queue
    names = [r.request_id for r in low] + ["high"]
    driver.wait(lambda: all(driver.finished(n) for n in names))
    first_step = {n: driver.steps_at[n][0] for n in names}
    assert first_step["high"] == min(first_step.values())  # in the first batch, ahead of two of the lows
    assert first_step["low2"] > first_step["high"]  # only MAX_RUNNING run at once: the last low waited


def test_a_request_vllm_refuses_ends_rejected_and_the_core_steps_on(driver):
    driver.submit(RequestInput.of("refused", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=3, logprobs=8)),
                  greedy("after", [5, 6], 3))
    driver.wait(lambda: driver.finished("refused") and driver.finished("after"))
    last = driver.outputs["refused"][-1]
    assert last.finish_reason == FinishReason.REJECTED and len(driver.outputs["refused"]) == 1
    assert last.error_code == "invalid_params" and "vLLM" in last.error_message
    assert driver.outputs["after"][-1].finish_reason == FinishReason.LENGTH


def test_vllm_refuses_an_unknown_engine_argument_as_a_config_error(vllm_llama_path, vllm_python):
    cfg = vllm_config(vllm_python, no_such_argument=1)
    client = ProcessEngineClient(VllmEngine(str(vllm_llama_path), cfg, vllm_python), cfg.serving_tuning,
                                 log_level="WARNING")
    with pytest.raises(ValueError, match=r"model\.vllm_args: .*no_such_argument"):
        asyncio.run(client.start(asyncio.new_event_loop(), print, print))
    client.stop()


def test_a_missing_interpreter_is_a_config_error_naming_the_field(vllm_llama_path, tmp_path):
    cfg = vllm_config(str(tmp_path / "python"))
    with pytest.raises(ConfigError, match=r"model\.vllm_python"):
        VllmEngine(str(vllm_llama_path), cfg, str(tmp_path / "python")).start_core("INFO", None)


def test_the_settings_name_their_fields():
    with pytest.raises(ConfigError, match=r"model\.vllm_python is required"):
        ModelConfig(engine="vllm")
    with pytest.raises(ConfigError, match=r"model\.engine must be one of"):
        ModelConfig(engine="tgi")
    with pytest.raises(ConfigError, match=r"model\.vllm_args .* applies only"):
        ModelConfig(vllm_args={"enforce_eager": True})
    with pytest.raises(ConfigError, match=r"worker\.engine_process"):
        WorkerConfig(model=ModelConfig(engine="vllm", vllm_python="/x"), worker=WorkerSettings(engine_process=False))


def test_engine_arguments_derive_from_our_limits_and_vllm_args_win(vllm_llama_path):
    cfg = vllm_config("/x", max_num_seqs=7)
    derived = derived_engine_args(cfg)
    assert derived["max_num_seqs"] == MAX_RUNNING and derived["scheduling_policy"] == "priority"
    start = VllmStart(str(vllm_llama_path), derived, dict(cfg.model.vllm_args), 4096)
    on_cpu = engine_args(start, on_cpu=True)
    assert on_cpu["max_num_seqs"] == 7 and "gpu_memory_utilization" not in on_cpu
    # 2 layers x 1 KV head x 64 dims x K and V x 4 bytes per token
    assert on_cpu["kv_cache_memory_bytes"] == 4096 * 2 * 1 * 2 * 64 * 4
    on_gpu = engine_args(VllmStart(str(vllm_llama_path), derived, {}, None), on_cpu=False)
    assert on_gpu["gpu_memory_utilization"] == 0.85 and "kv_cache_memory_bytes" not in on_gpu


def test_structured_outputs_hold_their_constraint(driver):
    import json

    from schemas.params import ChoiceOutput, JsonSchemaOutput

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"]}  # bounded: a tiny random model would write digits forever
    driver.submit(
        RequestInput.of("json", prompt_token_ids=[5, 6, 7], params=SamplingParams(
            temperature=0, max_tokens=40, structured=JsonSchemaOutput(schema=schema))),
        RequestInput.of("choice", prompt_token_ids=[5, 6, 8], params=SamplingParams(
            temperature=0.8, seed=3, max_tokens=20, structured=ChoiceOutput(choices=["yes", "no"]))))
    driver.wait(lambda: driver.finished("json") and driver.finished("choice"))
    text = "".join(o.text for o in driver.outputs["json"])
    assert driver.outputs["json"][-1].finish_reason == FinishReason.STOP, text
    value = json.loads(text)
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "green")  # strict: no other property
    assert " " not in text  # compact, as our engine's JSON
    assert "".join(o.text for o in driver.outputs["choice"]) in ("yes", "no")


def test_stop_strings_seeds_and_logprobs_map_as_on_our_engine(driver, vllm_llama_path):
    from worker.engine import Engine

    prompt = [11, 12, 13, 14]
    ours = Engine.from_pretrained(str(vllm_llama_path), EngineConfig(model=ModelConfig(dtype="float32", device="cpu")))
    ref = ours.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    stop = driver.client.tokenizer.decode(ref.token_ids[3:5])  # text our detokenizer finds mid-stream
    driver.submit(
        RequestInput.of("lp", prompt_token_ids=prompt,
                        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)),
        *(RequestInput.of(f"seed{i}", prompt_token_ids=prompt,
                          params=SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True))
          for i in range(2)),
        RequestInput.of("stop", prompt_token_ids=prompt,
                        params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])))
    names = ("lp", "seed0", "seed1", "stop")
    driver.wait(lambda: all(driver.finished(n) for n in names))
    lps = [lp for o in driver.outputs["lp"] for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == ref.token_ids
    for got, exp in zip(lps, ref.logprobs, strict=True):
        assert got.logprob == pytest.approx(exp.logprob, abs=1e-3)
        assert got.top_token_ids == exp.top_token_ids and len(got.top_logprobs) == 2
    seeded = [[t for o in driver.outputs[f"seed{i}"] for t in o.new_token_ids] for i in range(2)]
    assert seeded[0] == seeded[1]  # the same seed, the same tokens
    stopped = driver.outputs["stop"][-1]
    assert stopped.finish_reason == FinishReason.STOP
    assert stop not in "".join(o.text for o in driver.outputs["stop"])  # our front-end cut it, as ours does


def test_a_core_process_that_dies_is_reported_as_an_engine_crash(vllm_llama_path, vllm_python):
    import os
    import signal

    cfg = vllm_config(vllm_python)
    d = Driver(ProcessEngineClient(VllmEngine(str(vllm_llama_path), cfg, vllm_python), cfg.serving_tuning,
                                   log_level="WARNING"))
    try:
        d.submit(greedy("doomed", [5, 6, 7], 900))
        d.wait(lambda: len(d.outputs.get("doomed", [])) >= 2)
        os.kill(d.client._proc.pid, signal.SIGKILL)  # as the OOM killer would
        deadline = time.monotonic() + 60
        while d.crash is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert isinstance(d.crash, EngineCrashed), d.crash  # the worker's crash path: stop, hand jobs back
        assert "exited" in str(d.crash) and not d.client.alive
    finally:
        d.stop()


def test_inflight_check_runs_vllms_own_validation(vllm_llama_path, vllm_python):
    """`inflight check`'s model checks with `engine: vllm`: vLLM's config validation in its
    interpreter (no weights loaded); a refused argument fails naming `model.vllm_args`."""
    from worker.cli.model_checks import model_checks

    def checks(**vllm_args):
        cfg = WorkerConfig(model=ModelConfig(path=str(vllm_llama_path), dtype="float32", engine="vllm",
                                             vllm_python=vllm_python, vllm_args=vllm_args))
        return {c.name: c for c in model_checks(cfg)}

    ok = checks(enforce_eager=True)
    assert ok["model"].status == "pass", ok["model"]
    assert "LlamaForCausalLM" in ok["model"].detail and "float32" in ok["model"].detail
    assert ok["kv cache"].status == "skip"
    assert ok["compile"].status == "skip" and "compilation_config" in ok["compile"].detail
    refused = checks(max_model_len=10**7)  # beyond the checkpoint's context: vLLM's own check
    assert refused["model"].status == "fail" and refused["model"].setting == "model.vllm_args", refused["model"]
    assert "max_model_len" in refused["model"].detail


def test_the_core_process_waits_on_its_forwards_cpus(driver):
    """vLLM's core process spins while it waits for each step (`share_forward_cpus`):
    every one of its threads is bound to the CPUs of vLLM's forward process, where
    vLLM's CPU platform leaves a CPU for the rest (here the test's Kafka, Redis and
    client), so that spin never takes the rest's CPU."""
    import psutil

    core = psutil.Process(driver.client._proc.pid)
    forwards = [p for p in core.children(recursive=True) if os.sched_getaffinity(p.pid) != os.sched_getaffinity(0)]
    if not forwards:
        pytest.skip("vLLM bound its forward to every CPU this test may use: nothing to share")
    wanted = set().union(*(os.sched_getaffinity(p.pid) for p in forwards))
    for t in core.threads():
        assert os.sched_getaffinity(t.id) == wanted
