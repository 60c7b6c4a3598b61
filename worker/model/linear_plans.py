"""The float32 linear layers' plans (`worker.model.small_batch`, `model.cpu_linear: auto`)
kept per box: timed at the first start, read at every later one.

A plan decides which layers become `SmallBatchLinear` and which weights are held packed
only, and both are part of a captured forward's key (`worker.model.compiled.artifact_key`).
Plans timed anew at every start differ by the timing's noise wherever two paths are
close, and the next start then traces and captures its forward again instead of loading
it. Kept, a box's plans are the same at every start, and so are its captured forwards (an
autotuner's cache, as Triton's and inductor's keep their choices).

File: `<cache>/inflight/linear-plans/<hash>.json` (`<cache>`: `$XDG_CACHE_HOME`, default
`~/.cache`), the hash of what the timings depend on: the CPU (model name and feature
flags), the machine, torch's version and intra-op thread count, whether oneDNN can pack
weights, the kernel's build (`cbuild`: `cpu_woq.c`'s source, the compiler and flags),
and the timing's source (`small_batch.py`). One entry per
weight shape, `"out,in,bias,large,kernel"` -> the plan (a list of methods, `small_batch.TORCH` /
`KERNEL` / `PACKED` per row bucket) or null (torch's GEMM throughout). Delete the file to
time again at the next start; a file that does not parse, or a plan that does not fit its
shape, is timed again and rewritten; a file that cannot be written is logged and the
start goes on. A process reads a file once and holds its table: engines started one
after another in one process all make the same model even where another process timed
the same shapes meanwhile (processes timing one shape at once each keep their own plan;
the last to write leaves its plan for later starts, and every shape each timed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
from pathlib import Path

import torch

from worker.model.kernels import cbuild

log = logging.getLogger(__name__)

ShapeKey = tuple[int, int, bool, bool, bool]  # out_features, in_features, bias, large, kernel
Plan = tuple[int, ...] | None


# the timing's own source; the kernel's source, compiler and flags come in by its build's name
SOURCES = (Path(__file__).with_name("small_batch.py"),)


_TABLES: dict[Path, PlanCache] = {}
_TABLES_LOCK = threading.Lock()


def plans_dir() -> Path:
    """Where the plans of this box are kept (module docstring)."""
    return cbuild.cache_dir().parent / "linear-plans"


class PlanCache:
    """The plans timed on this box, by weight shape (module docstring). Safe to share
    between threads.

    Args:
        path: the file (`for_this_box` names it); read now where it exists.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._plans = self._read(warn=True)
        self._added: dict[str, list[int] | None] = {}  # timed here, not yet written

    def _read(self, warn: bool = False) -> dict[str, list[int] | None]:
        """The file's table; empty where it is missing or is not a table of plans (logged
        when `warn`)."""
        try:
            got = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            if warn:
                log.warning("linear plans at %s unreadable (%s); timing again", self.path, e)
            return {}
        if isinstance(got, dict) and all(v is None or (isinstance(v, list) and all(type(h) is int for h in v))
                                         for v in got.values()):
            return got
        if warn:
            log.warning("linear plans at %s are not a table of plans; timing again", self.path)
        return {}

    @classmethod
    def for_this_box(cls, packable: bool) -> PlanCache:
        """The cache of this box, torch's thread count now and whether oneDNN can pack
        weights (`packable`)."""
        h = hashlib.sha256()
        for part in (cbuild.cpu_identity(), platform.machine(), torch.__version__, str(torch.get_num_threads()),
                     "packable" if packable else "-", _kernel_build()):
            h.update(part.encode() + b"\0")
        for src in SOURCES:
            h.update(src.read_bytes() if src.is_file() else b"")
        path = plans_dir() / f"{h.hexdigest()[:16]}.json"
        with _TABLES_LOCK:  # one table per file in a process: its engines all make the same model
            if path not in _TABLES:
                _TABLES[path] = cls(path)
            return _TABLES[path]

    @staticmethod
    def _key(shape: ShapeKey) -> str:
        return ",".join(str(int(v)) for v in shape)

    def get(self, shape: ShapeKey) -> tuple[bool, Plan]:
        """(found, its plan): the plan kept for this weight shape, if any (as the file
        has it: the caller checks that it fits the shape, `small_batch._plan_fits`)."""
        key = self._key(shape)
        with self._lock:
            if key not in self._plans:
                return False, None
            plan = self._plans[key]
        return True, None if plan is None else tuple(plan)

    def put(self, shape: ShapeKey, plan: Plan) -> None:
        """Keep a plan just timed (written by `save`)."""
        key, value = self._key(shape), None if plan is None else list(plan)
        with self._lock:
            self._plans[key] = self._added[key] = value

    def save(self) -> None:
        """Write the plans timed since the last save into the file: under an exclusive
        lock on `<file>.lock`, the file read again and the new plans merged in (so that
        processes writing at once keep each other's shapes), then replaced atomically
        (a start never reads half of one)."""
        with self._lock:
            added, self._added = self._added, {}
        if not added:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                table = {**self._read(), **added}
                with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                    tmp = f.name
                    f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(table.items()))
                            + "\n}\n")
                os.replace(tmp, self.path)
        except OSError as e:
            log.warning("linear plans not kept at %s (%s): the next start times them again", self.path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def _kernel_build() -> str:
    """The small-batch kernel's build (its file's name: a hash of its source, compiler,
    flags and CPU, `cbuild`), or why there is none."""
    from worker.model.kernels import cpu_woq

    lib = cpu_woq._library()
    return lib if isinstance(lib, str) else Path(getattr(lib, "_name", "")).name
