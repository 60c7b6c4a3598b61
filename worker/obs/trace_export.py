"""The trace export process: a worker's (or gateway's) finished spans are encoded and sent
to the collector by a child process, off the serving process's GIL.

Why: at 100% sampling a worker serving ~700 jobs/s spent more CPU exporting spans (the
SDK's protobuf encoder, ~0.7 ms per job of nine spans, and the HTTP posts) than building
them, on a batch-processor thread that shares the event loop's GIL: 0.65-0.71x the
tokens/s of tracing off (docs/benchmarks.md#tracing-overhead). vLLM and SGLang export
from the serving process; the OpenTelemetry Collector's agent pattern is the model here,
one hop closer: the serving process only builds compact records
(`worker.obs.span_records`: a job's phase spans are one record) and writes them,
msgpack-encoded, in batches, into a pipe.

Parent side, `ExportProcess`: `put` (any thread; on the event loop for a job's spans)
appends a record to a bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`, default 2048 records; a
full queue drops the record and counts its spans); a writer thread sends the queue every
50 ms (sooner past 512 records) as one frame; a reader thread takes the child's counts
(spans exported and dropped, whether exports are failing) and logs one warning per
failing episode, as the in-process exporter does. A child that dies is started again (at
most every 5 s; its spans in flight are lost and counted).

Child side, `main` (`python -m worker.obs.trace_export SETTINGS_JSON`): batches the
records (`RecordBatcher`, `OTEL_BSP_*`) for the OTLP exporter the settings name
(`worker.obs.exporters.otlp_exporter`: http/protobuf and http/json encoded straight from
the records, grpc through the SDK; `OTEL_*` variables honoured as in-process). It ignores
SIGINT and SIGTERM (a signal to the whole process group must not end it before the
worker's last spans): it ends when its standard input closes (the worker stops it, or
died), after a final flush bounded by the settings' `timeout_s`.

Frames, both ways: a 4-byte big-endian length, then msgpack. Parent to child:
`[0, [record, ...]]` (`SpanRecord` or `Children`) or `[1, n]` (flush request n). Child to
parent: `[exported, dropped, failing, error, flushed]`: first a hello (`flushed` = -1;
`error` says why it could not start: the first start waits for it and raises
ConfigError), then after every export and every flush.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec
import structlog

from worker.obs.exporters import batch_settings
from worker.obs.span_records import Record, num_spans, record_of

log = structlog.get_logger(__name__)

SPANS, FLUSH = 0, 1
FLUSH_S = 0.05  # the writer sends what is queued this often...
SEND_AT = 512  # ...or as soon as this many records wait
MAX_FRAME_RECORDS = 4096
RESTART_GAP_S = 5.0
START_S = 60.0  # a first start waits this long for the child's hello (imports on a loaded box)
HELLO = -1  # the `flushed` of the child's first frame: ready, or why not (its `error`)
_LEN = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def read_frame(stream: Any) -> bytes | None:
    """The next frame's payload from a binary stream, or None at its end."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = _LEN.unpack(head)
    body = stream.read(n)
    return body if len(body) == n else None


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ExportProcess:
    """The serving process's end of the export process (see the module docstring).

    Args:
        settings: what the child needs: `tracing` (the TracingConfig fields: endpoint,
            protocol), `resource` (the resource attributes), `log_level`, `timeout_s`.
        where: the collector's address, for log lines.

    `num_exported` / `num_dropped`: spans the child exported / spans dropped anywhere
    (queue full here, a child that died, an export that failed).

    Raises:
        ValueError: invalid `OTEL_BSP_*` values (`batch_settings`).
        ConfigError: the child did not start (its reason, e.g. the gRPC exporter missing).
    """

    def __init__(self, settings: dict, where: str) -> None:
        self.settings = settings
        self.where = where
        self.max_queue = batch_settings()[1]
        self.failing = False
        self._queue: deque[Record] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._encoder = msgspec.msgpack.Encoder()
        self._cond = threading.Condition()
        self._flush_asked = 0
        self._flush_sent = 0
        self._flushed = 0
        self._base = [0, 0]  # exported, dropped by children that ended
        self._child = [0, 0]  # the running child's counts
        self._queue_dropped = 0  # written by the putting thread only
        self._lost = 0  # written by the writer thread only: sent to a child that was gone
        self._queue_full = False
        self._started_at = 0.0
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error = ""
        self._start()
        if not self._ready.wait(START_S) or self._start_error:
            self._proc.kill()
            from worker.config import ConfigError

            raise ConfigError("tracing: the trace export process did not start: "
                              f"{self._start_error or f'no answer within {START_S:.0f} s'}")
        self._writer = threading.Thread(target=self._write_loop, name="inflight-trace-pipe", daemon=True)
        self._writer.start()

    # ---- counts --------------------------------------------------------------------------
    @property
    def num_exported(self) -> int:
        return self._base[0] + self._child[0]

    @property
    def num_dropped(self) -> int:
        return self._base[1] + self._child[1] + self._queue_dropped + self._lost

    # ---- the serving side ----------------------------------------------------------------
    def put(self, record: Record) -> None:
        """Queue one record of finished spans for export; never blocks (a full queue
        drops it and counts its spans)."""
        q = self._queue
        if len(q) >= self.max_queue:
            self._queue_dropped += num_spans((record,))
            if not self._queue_full:
                self._queue_full = True
                log.warning("trace export queue full: spans are dropped (OTEL_BSP_MAX_QUEUE_SIZE)",
                            max_queue_size=self.max_queue)
            return
        q.append(record)
        if len(q) == SEND_AT:
            self._wake.set()

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Send what is queued and wait until the child has exported it (or `timeout_s`).
        False on timeout or when the child is gone."""
        with self._cond:
            self._flush_asked += 1
            want = self._flush_asked
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._flushed < want:
                left = deadline - time.monotonic()
                if left <= 0 or self._proc is None or self._proc.poll() is not None:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Send what is queued, close the pipe (the child flushes, bounded by its
        `timeout_s`, and exits) and wait for the child up to `timeout_s` + 1 s; a child
        still running then is killed and what it held is dropped (returns False)."""
        self._closing = True
        self._wake.set()
        self._writer.join(timeout_s)
        proc = self._proc
        if proc is None:
            return True
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout_s + 1.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False
        finally:
            if self._reader is not None:
                self._reader.join(1.0)
        return True

    # ---- the child -----------------------------------------------------------------------
    def _start(self) -> None:
        self._started_at = time.monotonic()
        self._ready.clear()
        self._proc = subprocess.Popen([sys.executable, "-m", "worker.obs.trace_export", json.dumps(self.settings)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._reader = threading.Thread(target=self._read_loop, args=(self._proc,), name="inflight-trace-counts",
                                        daemon=True)
        self._reader.start()

    def _child_gone(self, dropped: int) -> None:
        """The child died (a write failed): count what was lost, start another (at most
        every RESTART_GAP_S; until then spans are dropped and counted)."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            self._base[0] += self._child[0]
            self._base[1] += self._child[1]
            self._child = [0, 0]
            log.warning("trace export process exited; spans are dropped until it is started again", exit_code=code,
                        endpoint=self.where)
        self._lost += dropped
        if not self._closing and time.monotonic() - self._started_at >= RESTART_GAP_S:
            self._start()  # replaces self._proc: force_flush never sees a gap
        else:
            self._proc = None

    def _send(self, payload: bytes, spans: int) -> None:
        """Write one frame (holding `spans` spans) to the child."""
        proc = self._proc
        if proc is None:
            self._child_gone(spans)
            return
        try:
            write_all(proc.stdin.fileno(), frame(payload))
        except (OSError, ValueError):  # a broken pipe: the child is gone
            self._child_gone(spans)

    def _write_loop(self) -> None:
        q = self._queue
        while True:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            while q:
                batch = [q.popleft() for _ in range(min(len(q), MAX_FRAME_RECORDS))]
                self._send(self._encoder.encode((SPANS, batch)), num_spans(batch))
            if self._queue_full and len(q) < self.max_queue // 2:
                self._queue_full = False
            if self._flush_sent < self._flush_asked:
                self._flush_sent = self._flush_asked
                self._send(self._encoder.encode((FLUSH, self._flush_sent)), 0)
            if self._closing and not q:
                return

    def _read_loop(self, proc: subprocess.Popen) -> None:
        decoder = msgspec.msgpack.Decoder(tuple[int, int, bool, str, int])
        while True:
            payload = read_frame(proc.stdout)
            if payload is None:
                if not self._ready.is_set():
                    self._start_error = f"it exited with code {proc.wait()} (its error is in the log above)"
                    self._ready.set()
                return
            exported, dropped, failing, error, flushed = decoder.decode(payload)
            if flushed == HELLO:
                self._start_error = error
                self._ready.set()
                continue
            if proc is not self._proc or proc.returncode is not None:  # a child replaced, or reaped as gone
                return
            self._child = [exported, dropped]
            if failing and not self.failing:
                log.warning("trace export failed: spans are dropped until the collector answers; jobs are unaffected",
                            endpoint=self.where, error=error or "export refused or unreachable")
            elif self.failing and not failing:
                log.info("trace export works again", endpoint=self.where, dropped_spans=self.num_dropped)
            self.failing = failing
            with self._cond:
                self._flushed = max(self._flushed, flushed)
                self._cond.notify_all()


class RecordProcessor:
    """An SDK SpanProcessor that hands ordinary SDK spans (the gateway's SERVER spans, the
    client's PRODUCER spans), as they end, to a sink as records."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self.sink.put(record_of(span))

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.sink.force_flush(timeout_millis / 1000)


# ---- the child process ---------------------------------------------------------------------
def _ignored(signum: int, frame: object) -> None:
    pass


def main(argv: list[str]) -> int:
    """The export process (see the module docstring): `argv[0]` is the settings JSON."""
    settings = json.loads(argv[0])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignored)
    from worker.obs.log import setup_logging

    setup_logging(settings.get("log_level", "INFO"), json=True)
    for name in ("opentelemetry.exporter", "opentelemetry.sdk.trace.export"):  # the worker reports from our counts
        logging.getLogger(name).setLevel(logging.CRITICAL)
    from opentelemetry.sdk.resources import Resource

    from worker.config import TracingConfig
    from worker.obs.exporters import RecordBatcher, ReportingExporter, otlp_exporter

    out = sys.stdout.buffer
    lock = threading.Lock()
    encoder = msgspec.msgpack.Encoder()
    state = {"flushed": 0}

    def send(*counts: Any) -> None:
        with lock:
            try:
                out.write(frame(encoder.encode(counts)))
                out.flush()
            except (OSError, ValueError):
                pass  # the worker is gone: nothing to tell

    try:
        resource = Resource.create(settings.get("resource") or {})
        exporter, _, where = otlp_exporter(TracingConfig(**settings["tracing"]), resource)
        reporting = ReportingExporter(exporter, where, log_episodes=False)
        batcher = RecordBatcher(reporting)  # OTEL_BSP_* read and checked here
    except Exception as e:  # what only this process finds out (an exporter it cannot build): the worker raises it
        send(0, 0, False, f"{type(e).__name__}: {e}"[:500], HELLO)
        return 2
    send(0, 0, False, "", HELLO)

    def report() -> None:
        send(reporting.num_exported, reporting.num_dropped, reporting.failing, reporting.last_error, state["flushed"])

    reporting.listener = report
    spans = msgspec.msgpack.Decoder(list[Record])
    head = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
    stdin = sys.stdin.buffer
    while (payload := read_frame(stdin)) is not None:
        kind, body = head.decode(payload)
        if kind == SPANS:
            for record in spans.decode(body):
                batcher.put(record)
        elif kind == FLUSH:
            batcher.force_flush()
            state["flushed"] = msgspec.msgpack.decode(body, type=int)
            report()
    batcher.shutdown(float(settings.get("timeout_s", 5.0)))
    report()
    return 0


if __name__ == "__main__":
    from worker.obs.exits import exit_now

    exit_now(main(sys.argv[1:]))  # the worker's stop waits on this exit: no interpreter teardown
