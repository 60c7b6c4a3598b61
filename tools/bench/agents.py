"""Agent outputs benchmark, all numbers from one run on one machine:

  validity  --jobs sampled "auto" requests (weather / time questions and small talk,
            both tools offered) on the agent model (tools/make_agent_model.py), run
            through the engine with the gateway's constrained-auto grammar and without
            it, at each --temperatures: how many outputs open a call (`<tool_call>`)
            and how many of those fail (the call does not parse, names no tool, or its
            arguments fail the tool's JSON Schema), those cut by `max_tokens` (80)
            counted apart. The goal with the grammar is 0 failures of complete calls.
  parser    the gateway's reading of a streamed answer (reasoning + tool calls,
            `worker.gateway.agents.OutputParser`) per delta vs passing the text through:
            microseconds per delta, on the validity run's real outputs, token by token.
  --loop    the OpenAI Agents SDK against a fleet: the dev stack, one worker process
            serving the agent model, two gateway processes (constrained "auto" on and
            off); --agents concurrent agents each run --runs weather questions (ask, the
            model calls `get_weather`, the SDK runs it and feeds the result back, the
            model answers) at --loop-temperature: model turns per second, and of the
            questions, how many got a valid call, a call the SDK refused (malformed
            arguments), or no call at all.

Writes bench_agents.json and bench_agents.png under --out, prints a table.

    python -m tools.bench.agents                 # ~2 min on the 2-core CPU box
    python -m tools.bench.agents --jobs 1000 --temperatures 1.0 1.5
    tools/stack/devstack.sh up && python -m tools.bench.agents --loop   # + the Agents SDK loop (~2 min more)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path

import jsonschema

from schemas.params import GrammarOutput, SamplingParams
from schemas.tool_parsers import parse
from tools.bench.connections import add_connection_args
from tools.bench.harness import report_header, write_report
from tools.make_agent_model import CITIES, SMALL_TALK, TIME_ASKS, TIME_TOOL, WEATHER_ASKS, WEATHER_TOOL, ZONES
from worker.gateway.agents import OutputFormats, OutputParser, tool_call_grammar

AGENT_MODEL = Path(".cache/models/agent-tiny")
TOOLS = [WEATHER_TOOL, TIME_TOOL]
FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ensure_agent_model(path: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        from tools.make_agent_model import make_agent_checkpoint

        make_agent_checkpoint(path)
    return path


def prompts(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            ask = rng.choice(WEATHER_ASKS).format(c=rng.choice(CITIES))
        elif r < 0.8:
            ask = rng.choice(TIME_ASKS).format(z=rng.choice(ZONES))
        else:
            ask = rng.choice(SMALL_TALK)[0]
        out.append([{"role": "user", "content": ask}])
    return out


def judge(text: str) -> tuple[bool, str | None]:
    """(the answer opens a call, why a call fails or None)."""
    answer = text.split("</think>", 1)[-1]
    if "<tool_call>" not in answer:
        return False, None
    parsed = parse("hermes", answer)
    if not parsed.calls or (parsed.content and "<tool_call>" in parsed.content):
        return True, "does not parse"
    for call in parsed.calls:
        if call.name not in FUNCTIONS:
            return True, f"unknown tool {call.name!r}"
        try:
            jsonschema.validate(json.loads(call.arguments), FUNCTIONS[call.name])
        except jsonschema.ValidationError as e:
            return True, f"arguments: {e.message}"
    return True, None


def run_validity(engine, jobs: int, temperature: float, constrained: bool) -> tuple[dict, list[list[str]]]:
    from worker.engine.inputs import RequestInput

    grammar = GrammarOutput(grammar=tool_call_grammar("hermes", FUNCTIONS)) if constrained else None
    pieces: dict[str, list[str]] = {}
    cut: set[str] = set()  # ended by max_tokens
    for i, messages in enumerate(prompts(jobs)):
        params = SamplingParams(max_tokens=80, temperature=temperature, seed=i, structured=grammar)
        engine.add(RequestInput.of(f"r{i}", messages=messages, tools=TOOLS, params=params))
        pieces[f"r{i}"] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            pieces[out.request_id].append(out.text)
            if out.finished and out.finish_reason == "length":
                cut.add(out.request_id)
    seconds = time.perf_counter() - t0
    opened = failed = 0
    reasons: dict[str, int] = {}
    examples: list[str] = []
    for rid, parts in pieces.items():
        opens, why = judge("".join(parts))
        if why is not None and rid in cut:
            why = "cut by max_tokens"
        opened += opens
        if why is not None:
            failed += 1
            reasons[why.split(":")[0]] = reasons.get(why.split(":")[0], 0) + 1
            examples.append("".join(parts)[-160:])
    return ({"jobs": jobs, "temperature": temperature, "constrained": constrained, "opened_calls": opened,
             "failed_calls": failed, "valid_rate": (opened - failed) / opened if opened else None,
             "failure_kinds": reasons, "failure_examples": examples[:5], "seconds": round(seconds, 2)}, list(pieces.values()))


def run_parser(outputs: list[list[str]], rounds: int = 3) -> dict:
    formats = OutputFormats("hermes", "deepseek_r1")
    deltas = sum(len(p) for p in outputs)
    best = {"plain": float("inf"), "parsed": float("inf")}
    for _ in range(rounds):
        t0 = time.perf_counter()
        sink: list = []
        for parts in outputs:
            for piece in parts:
                sink.append({"content": piece})  # what the renderer builds without a parser
        best["plain"] = min(best["plain"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        for parts in outputs:
            parser = OutputParser(formats, tools=True)
            for piece in parts:
                parser.feed(piece, 1)
            parser.finish()
        best["parsed"] = min(best["parsed"], time.perf_counter() - t0)
    return {"deltas": deltas, "plain_us_per_delta": best["plain"] / deltas * 1e6,
            "parsed_us_per_delta": best["parsed"] / deltas * 1e6}


async def _agent_runs(port: int, key: str, a) -> dict:
    """--agents concurrent Agents SDK agents, --runs questions each, through one gateway."""
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import AgentsException

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
    counts = {"valid_call": 0, "refused_call": 0, "no_call": 0, "turns": 0}

    def weather_tool(called: list[str]):
        @function_tool
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            called.append(city)
            return json.dumps({"city": city, "sky": "sunny", "temperature_c": 20})

        return get_weather

    async def agent_loop(i: int) -> None:
        for j in range(a.runs):
            called: list[str] = []
            agent = Agent(name="weather", instructions="You are a helpful assistant.", tools=[weather_tool(called)],
                          model=OpenAIChatCompletionsModel(model="bench", openai_client=client),
                          model_settings=ModelSettings(temperature=a.loop_temperature, max_tokens=80))
            city = CITIES[(i * a.runs + j) % len(CITIES)]
            try:
                result = await Runner.run(agent, WEATHER_ASKS[j % len(WEATHER_ASKS)].format(c=city), max_turns=3)
                counts["turns"] += len(result.raw_responses)
                counts["valid_call" if called else "no_call"] += 1
            except AgentsException:  # the SDK refused a call (arguments not JSON, unknown tool) or ran out of turns
                counts["refused_call"] += 1
                counts["turns"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(agent_loop(i) for i in range(a.agents)))
    seconds = time.perf_counter() - t0
    await client.close()
    return {**counts, "seconds": round(seconds, 2), "turns_per_s": round(counts["turns"] / seconds, 2)}


async def run_loop(a, model: Path) -> dict:
    """The fleet (worker + a gateway per setting) and the agents through each gateway."""
    import subprocess
    import tempfile

    from tools.bench.connections import connection_sections
    from tools.bench.gateway import KEY, readyz, start_gateway, write_configs
    from worker.cli.topics import create_topics

    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    prefix = f"agb{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=2, kafka=a.kafka_cfg)
    worker_fields = {"model": {"path": str(model), "dtype": "float32", "device": "cpu"},
                     "serving_tuning": {"max_running_requests": 32, "max_total_tokens": 16384,
                                        "max_batched_tokens": 2048, "max_output_tokens": 256}}
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(a.out) / "bench_agents_processes.log", "a")  # noqa: SIM115 (outlives this block's steps)
        procs = []
        try:
            for constrained in (True, False):
                sub = Path(tmp) / str(constrained)
                sub.mkdir()
                port, env = write_configs(a, prefix, sub, worker_fields,
                                          {"tokenizer": str(model), "constrained_tool_calls": constrained})
                if not procs:
                    procs.append(subprocess.Popen([sys.executable, "-m", "worker", "worker", "--config",
                                                   str(sub / "worker.yaml")], stdout=log, stderr=subprocess.STDOUT,
                                                  env=env))
                procs.append(start_gateway(sub, log, env))
                await readyz(port, 180.0)
                await _agent_runs(port, KEY, argparse.Namespace(**{**vars(a), "agents": 2, "runs": 1}))  # warm-up
                out["grammar" if constrained else "free"] = await _agent_runs(port, KEY, a)
        finally:
            for p in procs:
                p.terminate()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    return out


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["validity"]
    labels = [f"T={r['temperature']}\n{'grammar' if r['constrained'] else 'free'}" for r in rows]
    rates = [100 * (r["valid_rate"] or 0) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, rates, color=["tab:green" if r["constrained"] else "tab:gray" for r in rows])
    ax.set_ylabel("calls that parse and validate (%)")
    ax.set_ylim(0, 105)
    ax.set_title("auto tool calls, agent model")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=AGENT_MODEL)
    p.add_argument("--jobs", type=int, default=500)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 1.5])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--loop", action="store_true", help="also run the Agents SDK loop against a fleet (dev stack)")
    p.add_argument("--agents", type=int, default=8, help="--loop: concurrent agents")
    p.add_argument("--runs", type=int, default=8, help="--loop: questions per agent")
    p.add_argument("--loop-temperature", type=float, default=1.0)
    add_connection_args(p)
    a = p.parse_args(argv)
    a.command_line = " ".join(["python -m tools.bench.agents", *(argv if argv is not None else sys.argv[1:])])
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    model = ensure_agent_model(a.model)
    engine = Engine.from_pretrained(str(model), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu"),
        serving_tuning=ServingTuning(max_running_requests=32, max_total_tokens=16384, max_batched_tokens=2048)))
    report = report_header("agents", a, model, "cpu")
    report["validity"] = []
    outputs: list[list[str]] = []
    for temperature in a.temperatures:
        for constrained in (True, False):
            row, texts = run_validity(engine, a.jobs, temperature, constrained)
            report["validity"].append(row)
            outputs += texts
            print(f"T={temperature:<4} {'grammar' if constrained else 'free   '}  {row['opened_calls']:4d} calls opened, "
                  f"{row['failed_calls']:3d} failed {row['failure_kinds'] or ''} ({row['seconds']} s)")
    report["parser"] = run_parser(outputs)
    pr = report["parser"]
    print(f"parser: {pr['parsed_us_per_delta']:.1f} us per delta (pass-through {pr['plain_us_per_delta']:.2f} us), "
          f"{pr['deltas']} deltas")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.loop:
        del engine  # its threads: the fleet's worker gets the cores
        report["loop"] = asyncio.run(run_loop(a, model))
        for name, row in report["loop"].items():
            print(f"agents SDK loop, {name:7}: {row['turns_per_s']} model turns/s; of {a.agents * a.runs} questions "
                  f"{row['valid_call']} valid calls, {row['refused_call']} refused, {row['no_call']} without a call")
    write_report(report, out, "bench_agents.json")
    _plot(report, out / "bench_agents.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
