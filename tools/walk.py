"""Walk one job through the worker's calls and count its hand-offs (issue 43's measure).

Runs one in-process worker (its engine stepped in a thread) against the dev stack's Kafka
and Redis, submits one job, and traces every Python call in `worker/` and `schemas/`
(`sys.setprofile` on the event loop, the input pool and the engine thread) while the job
goes through. A call is a *stop of the job* when one of its arguments, `self` included,
is the job: its id string, an object whose `job_id` or `request_id` is that id or whose
`job` is the job (the Kafka record, the local job, the request input, the engine
request, the scheduler's request, outputs), or a list / tuple / dict holding one. A
coroutine's resumption is not a new call, nor its suspension a return. The walk is the
files of those stops in order, plus the file control returns to when such a call ends;
consecutive stops in one file are one stop; a *helper* (a property of the job read, or a
module-level function that passes the job only to other helpers: a key's name, an
encoder) is counted apart, not as a stop. Reported per segment:

  intake:  from `JobStarter.take` to the engine client's `submit` (serving side: claim,
           start rules, input processing, the door to the engine), and the return to
           the starter;
  engine:  inside `submit` and in the engine thread until the job's first forward
           (engine side: the output processor, the core, its queue of arrivals);
  output:  from there to `Finalizer._done` (accepted, outputs → drafts → numbered
           events → the stream → the offset marked done).

For each: stops, returns (stops in a file already left: stops minus distinct files),
the files, the names the job goes by (the parameter names that held it), and the most
values passed beside the job object at any door (arguments that are not the job,
`self`, `cls` and None left out). Usage (dev stack up: `tools/stack/devstack.sh up`):

    python -m tools.walk [--model DIR] [--out walk.json]

`--model` defaults to the test suite's tiny Llama (`.cache/test-models/tiny-llama-v1`,
made by the first test run). Prints one table and writes the walks as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dis
import inspect
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (str(ROOT / "worker") + "/", str(ROOT / "schemas") + "/")
IGNORED = (str(ROOT / "worker" / "client") + "/",)  # the client that submits the job and reads its stream
SEGMENTS = ("intake", "engine", "output")


def _holds(value, job_id: str, depth: int = 0) -> bool:
    """True when `value` is the job (its id, or an object carrying it) or holds it."""
    if value is job_id or (type(value) is str and value == job_id):
        return True
    if depth == 0 and type(value) in (list, tuple, set, frozenset):
        return len(value) <= 256 and any(_holds(v, job_id, 1) for v in value)
    if depth == 0 and type(value) is dict:
        return len(value) <= 256 and any(_holds(v, job_id, 1) for v in value.values())
    for attr in ("job_id", "request_id", "job"):
        try:
            if isinstance(getattr(type(value), attr, None), property):  # never run code to look
                continue
            got = getattr(value, attr, None)
        except Exception:  # an object that refuses the lookup is not the job
            continue
        if got is not None and (got == job_id if attr != "job" else getattr(got, "job_id", None) == job_id):
            return True
    return False


def _ours(path: str) -> bool:
    """A file of the worker's (not the client that drives the job)."""
    return path.startswith(SOURCES) and not path.startswith(IGNORED)


def _is_door(code) -> bool:
    """The engine client's `submit`: where the serving side hands the request on."""
    return code.co_name == "submit" and code.co_filename.endswith("core_client.py")


def _suspends(frame) -> bool:
    """True when a coroutine or generator frame's "return" event is a suspension (it
    stopped at a yield, an `await` inside), not its end; a resumption's "call" event is
    then no new call either."""
    return frame.f_code.co_flags & _RESUMABLE and frame.f_code.co_code[frame.f_lasti] == _YIELD


_RESUMABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
_YIELD = dis.opmap["YIELD_VALUE"]


@dataclass
class Call:
    """One call that held the job: where, what, and whether it led to other stops."""

    path: str
    qualname: str
    held: list[str]
    beside: list[str]
    caller: str | None = None  # the file control returned to (None: not ours, or still running)
    inner: list[Call] = field(default_factory=list)  # the stops made inside it
    accessor: bool = False  # a property of the job read (`held.text`)

    @property
    def helper(self) -> bool:
        """A property of the job read, or a module-level function that passes the job
        only to other helpers (a key's name, an encoder, a size): reading the job's path
        one does not follow it."""
        return self.accessor or ("." not in self.qualname and all(c.helper for c in self.inner))


@dataclass
class Segment:
    """One segment's calls in order."""

    events: list[tuple[str, Call]] = field(default_factory=list)  # ("call" | "return", the call)

    def report(self) -> dict:
        """The walk: each call's file, then its caller's on return, consecutive duplicates
        merged; a *helper* (a module-level function that held the job and passed it
        nowhere, such as a key's name or an encoder) is counted apart, not as a stop:
        reading the path one does not follow it."""
        stops: list[str] = []
        names: set[str] = set()
        widest, at, helpers = 0, "", 0

        def visit(path: str) -> None:
            rel = str(Path(path).relative_to(ROOT))
            if not stops or stops[-1] != rel:
                stops.append(rel)

        for kind, c in self.events:
            if c.helper:
                helpers += kind == "call"
            elif kind == "return":
                if c.caller is not None:
                    visit(c.caller)
            else:
                visit(c.path)
                names.update(n for n in c.held if n != "self")
                if len(c.beside) > widest:
                    widest, at = len(c.beside), f"{Path(c.path).name}:{c.qualname}({', '.join(c.beside)})"
        return {"stops": len(stops), "returns": len(stops) - len(set(stops)), "files": len(set(stops)),
                "names": sorted(names), "helpers": helpers, "walk": stops,
                "calls": [f"{kind} {Path(c.path).name}:{c.qualname}({', '.join(c.held)})" for kind, c in self.events],
                "most_values_beside_the_job": widest, "at": at}


class Walker:
    """The profile function: decides each call's segment and records the calls that
    held the job. The event loop's calls are `intake` up to the engine client's
    `submit`, `engine` inside it, then `output` until `Finalizer._done` returns (the offset marked
    done, the job out of the table); the input pool's are `intake`; the engine thread's
    are `engine` until the job's first forward."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.loop_segment: str | None = None
        self.engine_open = True
        self.walks = {s: Segment() for s in SEGMENTS}
        self._live: dict[int, tuple[Call, str]] = {}  # frame id -> its call and segment
        self.done = threading.Event()

    def __call__(self, frame, event: str, arg) -> None:
        if id(frame) not in self._live:
            if event == "call":
                self._call(frame)
        elif event == "return" and not _suspends(frame):  # a coroutine's await is not its return
            self._returned(frame, *self._live.pop(id(frame)))

    def _segment(self) -> str | None:
        name = threading.current_thread().name
        if name == "inflight-engine":
            return "engine" if self.engine_open and self.loop_segment in ("engine", "output") else None
        if name.startswith("inflight-input"):
            return "intake" if self.loop_segment == "intake" else None
        return self.loop_segment if self.loop_segment != "over" else None

    def _call(self, frame) -> None:
        code = frame.f_code
        path = code.co_filename
        if not _ours(path):
            return
        if code.co_qualname == "ModelRunner.execute" and self.loop_segment is not None:
            self.engine_open = False  # the engine segment ends at its first forward with the job
        nargs = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:nargs + bool(code.co_flags & inspect.CO_VARARGS)
                                 + bool(code.co_flags & inspect.CO_VARKEYWORDS)]
        f_locals = frame.f_locals
        held = [n for n in names if n in f_locals and _holds(f_locals[n], self.job_id)]
        if not held:
            return
        self._advance(code.co_qualname)
        segment = self._segment()
        if segment is None:
            return
        beside = [n for n in names if n not in held and n not in ("self", "cls") and n in f_locals and f_locals[n] is not None]
        call = Call(path, code.co_qualname, held, beside)
        if "self" in held:
            call.accessor = isinstance(inspect.getattr_static(type(f_locals["self"]), code.co_name, None), property)
        outer = frame.f_back
        while outer is not None and id(outer) not in self._live:
            outer = outer.f_back
        if outer is not None:
            self._live[id(outer)][0].inner.append(call)
        self.walks[segment].events.append(("call", call))
        self._live[id(frame)] = (call, segment)
        if segment == "intake" and _is_door(code):
            self.loop_segment = "engine"  # the door: what submit does is the engine's

    def _returned(self, frame, call: Call, segment: str) -> None:
        caller = frame.f_back
        if caller is not None and _ours(caller.f_code.co_filename):
            call.caller = caller.f_code.co_filename
        self.walks[segment].events.append(("return", call))
        if self.loop_segment == "engine" and _is_door(frame.f_code):
            self.loop_segment = "output"
        elif call.qualname == "Finalizer._done":  # its offset marked done, the job out of the table
            self.loop_segment = "over"
            self.done.set()

    def _advance(self, qualname: str) -> None:
        """Segment boundaries, by the call that opens or closes each."""
        if self.loop_segment is None and qualname == "JobStarter.take":
            self.loop_segment = "intake"


async def _walk(model: str, services: tuple[str, str], job_id: str) -> Walker:
    from schemas.params import SamplingParams
    from worker.cli.topics import create_topics
    from worker.client import InflightClient
    from worker.engine import Engine
    from worker.serve.worker import Worker

    prefix = f"walk{uuid.uuid4().hex[:8]}"
    await create_topics(services[0], prefix, partitions=1)
    cfg = _config(model, services, prefix)
    engine = Engine.from_pretrained(model, cfg.engine)
    worker = Worker(cfg, engine=engine)
    task = asyncio.create_task(worker.run(install_signals=False))
    while not (worker.started.is_set() and worker.intake.consumer.assignment()):
        if task.done():
            task.result()
        await asyncio.sleep(0.1)
    walker = Walker(job_id)
    threading.setprofile(walker)
    sys.setprofile(walker)
    try:
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("Walk this job through the worker", params=SamplingParams(temperature=0, max_tokens=1),
                                job_id=job_id)
            async for _ in client.stream(job_id, timeout_s=60):
                pass
            deadline = time.monotonic() + 10
            while not walker.done.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        worker.request_stop()
        await task
    return walker


def _config(model: str, services: tuple[str, str], prefix: str):
    from worker.config import (
        KafkaConfig,
        MetricsConfig,
        ModelConfig,
        RedisConfig,
        ServingTuning,
        WorkerConfig,
        WorkerSettings,
    )

    return WorkerConfig(
        model=ModelConfig(path=model, dtype="float32", device="cpu", compile="off"),
        serving_tuning=ServingTuning(max_running_requests=8, max_total_tokens=4096, max_batched_tokens=256),
        kafka=KafkaConfig(bootstrap_servers=services[0], topic_prefix=prefix, group_id=f"{prefix}-workers"),
        redis=RedisConfig(url=services[1], key_prefix=prefix),
        worker=WorkerSettings(drain_timeout_s=10.0),
        metrics=MetricsConfig(port=0, host="127.0.0.1"),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.walk", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / ".cache" / "test-models" / "tiny-llama-v1"))
    p.add_argument("--kafka", default="127.0.0.1:19092")
    p.add_argument("--redis", default="redis://127.0.0.1:6390/0")
    p.add_argument("--calls", action="store_true", help="print every call that held the job")
    p.add_argument("--out", default=str(ROOT / "bench-results" / "walk.json"))
    a = p.parse_args(argv)
    if not Path(a.model, "config.json").is_file():
        p.error(f"--model {a.model}: no checkpoint there (the test suite makes the tiny one; or give a path)")
    walker = asyncio.run(_walk(a.model, (a.kafka, a.redis), f"walk-{uuid.uuid4().hex[:8]}"))
    report = {s: w.report() for s, w in walker.walks.items()}
    print(f"{'segment':8} {'stops':>5} {'returns':>7} {'files':>5} {'names':>5} {'beside':>6} {'helpers':>7}")
    for s, r in report.items():
        print(f"{s:8} {r['stops']:5} {r['returns']:7} {r['files']:5} {len(r['names']):5} "
              f"{r['most_values_beside_the_job']:6} {r['helpers']:7}")
    for s, r in report.items():
        print(f"\n{s}: " + " -> ".join(Path(f).name for f in r["walk"]))
        print(f"  names: {', '.join(r['names'])}")
        print(f"  widest door: {r['at']}")
        if a.calls:
            print("\n".join("    " + c for c in r["calls"]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
