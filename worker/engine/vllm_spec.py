"""Starting vLLM's engine core for the worker (`model.engine: vllm`): the front-end's side
of `vllm_core.py` (which runs in vLLM's interpreter and holds the rest of the story).

`VllmEngine` is a `core_proc.EngineSpec`: `start_core` runs `python -m
worker.engine.vllm_core` under `model.vllm_python` with `subprocess` (multiprocessing's
spawn would hand the child our `sys.path`, and with it our torch), two pipes passed as
file descriptors and wrapped in `multiprocessing.connection.Connection` on both sides
(the same framing as our own core's pipes), and a `PYTHONPATH` holding links to this
project's two pure-Python packages only. The first message down the pipe is `VllmStart`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from worker.config import ConfigError, EngineConfig
from worker.engine.core_proc import EngineSpec, PretrainedEngine


class VllmStart(msgspec.Struct, tag="vllm_start", array_like=True):
    """The first message to a vLLM core process: what to build. `derived`: engine
    arguments from `model` and `serving_tuning` (`derived_engine_args`); `user`:
    `model.vllm_args`, applied over them; `kv_tokens`: `serving_tuning.max_total_tokens`;
    `lora_dir` and `max_lora_rank`: `model`'s (adapters served, and the rank our checks
    allow: vLLM's own limit is the next rank it offers, `derived_engine_args`)."""

    model: str
    derived: dict[str, Any]
    user: dict[str, Any]
    kv_tokens: int | None = None
    log_level: str = "INFO"
    lora_dir: str | None = None
    max_lora_rank: int = 16


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


def derived_engine_args(config: EngineConfig) -> dict[str, Any]:
    """vLLM `EngineArgs` keywords for `config`'s model and `serving_tuning` limits, in
    vLLM's names (before `model.vllm_args`, which win key by key: `engine_args`)."""
    m, t = config.model, config.serving_tuning
    args: dict[str, Any] = {
        "max_num_seqs": t.max_running_requests,
        "max_num_batched_tokens": t.max_batched_tokens,
        "enable_prefix_caching": t.enable_prefix_caching,
        "gpu_memory_utilization": t.gpu_memory_utilization,
        "scheduling_policy": "priority",  # our priority classes (lower first, as vLLM's)
        # llguidance, as our engine's grammars, and compact JSON as ours (vLLM's guidance
        # back end reads the whitespace rule from this config, not from the request)
        "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
    }
    if m.dtype != "auto":
        args["dtype"] = m.dtype
    if m.max_model_len is not None:
        args["max_model_len"] = m.max_model_len
    if m.lora_dir is not None:
        # vLLM's max_loras is adapters in one batch, max_cpu_loras adapters kept loaded;
        # its rank limit takes listed values only: the smallest one covering ours
        args.update(enable_lora=True, max_loras=t.max_loras_per_batch or m.max_loras, max_cpu_loras=m.max_loras,
                    max_lora_rank=next((r for r in VLLM_LORA_RANKS if r >= m.max_lora_rank), m.max_lora_rank))
    return args  # the KV block size stays vLLM's: its attention back ends choose (CPU: multiples of 32)


class _CoreProcess:
    """A `subprocess.Popen` with the `multiprocessing.Process` methods the client uses."""

    def __init__(self, popen: subprocess.Popen, shim: str) -> None:
        self._popen = popen
        self._shim = shim

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        shutil.rmtree(self._shim, ignore_errors=True)

    def kill(self) -> None:
        self._popen.kill()


def _package_shim() -> str:
    """A directory holding links to this project's `worker` and `schemas` packages and
    nothing else: the child's whole view of our code. Its one distribution record
    declares `vllm_plugin.register` as a vLLM general plugin, so vLLM runs it in each of
    its processes (its CPU platform spawns its workers: nothing set up in the core
    process reaches them)."""
    import schemas
    import worker

    shim = tempfile.mkdtemp(prefix="inflight-vllm-")
    for pkg in (worker, schemas):
        src = Path(pkg.__file__).resolve().parent
        os.symlink(src, Path(shim) / src.name)
    dist = Path(shim) / "inflight_vllm_plugin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: inflight-vllm-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\ninflight = worker.engine.vllm_plugin:register\n")
    return shim


def engine_spec(path: str, config: EngineConfig) -> EngineSpec:
    """The spec of the engine `config.model.engine` names, for the checkpoint at `path`."""
    if config.model.engine == "vllm":
        return VllmEngine(path, config, config.model.vllm_python or "")
    return PretrainedEngine(path, config)


@dataclass(frozen=True)
class VllmEngine:
    """vLLM's engine for a local checkpoint (`model.engine: vllm`), run by `python`
    (`model.vllm_python`): a `core_proc.EngineSpec`. Its tokenizer is built here: vLLM's
    environment has a transformers of its own, whose pickles ours need not read."""

    core_sends_tokenizer: ClassVar[bool] = False
    path: str
    config: EngineConfig
    python: str
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the core process

    def build_engine(self):
        raise ConfigError("model.engine 'vllm' runs only in its own process (worker.engine_process: true)")

    def build_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)

    def start_core(self, log_level: str, engine_threads: int | None) -> tuple[_CoreProcess, Connection, Connection]:
        """Start the core process; (process, pipe to it, pipe from it). Raises ConfigError
        when `model.vllm_python` is not an executable file."""
        self._check_python()
        to_core_r, to_core_w = os.pipe()
        from_core_r, from_core_w = os.pipe()
        shim = _package_shim()
        argv = [self.python, "-m", "worker.engine.vllm_core", str(to_core_r), str(from_core_w)]
        try:
            popen = subprocess.Popen(argv, pass_fds=(to_core_r, from_core_w), env=self._env(shim), cwd=shim)
        finally:
            os.close(to_core_r)
            os.close(from_core_w)
        to_core = Connection(to_core_w, readable=False)
        to_core.send_bytes(msgspec.msgpack.encode(self.start_message(log_level)))
        return _CoreProcess(popen, shim), to_core, Connection(from_core_r, writable=False)

    def check(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """vLLM's own validation of the engine arguments, without loading weights (`inflight
        check`): `EngineArgs.create_engine_config()` in vLLM's interpreter
        (`vllm_core.check`). Returns what vLLM resolved (architecture, dtype, context,
        versions). Raises ConfigError when vLLM refuses the arguments (naming
        `model.vllm_args`) or the interpreter is missing; RuntimeError when the check
        process fails otherwise or runs past `timeout_s` seconds."""
        self._check_python()
        shim = _package_shim()
        try:
            done = subprocess.run([self.python, "-m", "worker.engine.vllm_core", "--check"], env=self._env(shim),
                                  cwd=shim, input=msgspec.msgpack.encode(self.start_message("WARNING")),
                                  capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vLLM's config check did not end within {timeout_s:g} s") from None
        finally:
            shutil.rmtree(shim, ignore_errors=True)
        lines = done.stdout.strip().splitlines()  # vLLM logs to stdout too: the verdict is the last line
        try:
            verdict = msgspec.json.decode(lines[-1]) if lines else {}
        except msgspec.DecodeError:
            verdict = {}
        if done.returncode == 0 and "error" not in verdict:
            return verdict
        if done.returncode == 2 and "error" in verdict:
            raise ConfigError(verdict["error"])
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise RuntimeError(f"vLLM's config check failed: {verdict.get('error') or tail[0]}")

    def start_message(self, log_level: str) -> VllmStart:
        """The first message to the core: this spec's settings in vLLM's terms."""
        t, m = self.config.serving_tuning, self.config.model
        lora_dir = str(Path(m.lora_dir).resolve()) if m.lora_dir is not None else None  # the child runs elsewhere
        return VllmStart(str(Path(self.path).resolve()), derived_engine_args(self.config), dict(m.vllm_args),
                         t.max_total_tokens, log_level, lora_dir, m.max_lora_rank)

    def _check_python(self) -> None:
        if not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            raise ConfigError(f"model.vllm_python: {self.python!r} is not an executable file (the interpreter of "
                              "an environment with vLLM installed, e.g. .cache/vllm-venv/bin/python)")

    def _env(self, shim: str) -> dict[str, str]:
        """Ours without our interpreter's paths, plus `env`; `PYTHONPATH` = the shim."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(self.env)
        env["PYTHONPATH"] = shim
        return env
