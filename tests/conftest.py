"""Shared fixtures: tiny random-init checkpoints made locally with tools/make_model.py.

Without CUDA, Triton kernels run only in Triton's interpreter, and Triton reads
TRITON_INTERPRET once, when it is first imported, which any test module may cause
(transformers and torch import it): so it is set here, before collection starts.

The suite's engines run eagerly unless a test asks for `model.compile: on`: compiling a
tiny model's forward costs 5-15 CPU-seconds at every engine start on the 2-core box,
and the suite starts a few hundred engines. `auto` (on for the CPU) is tested by the
unit tests of `worker.engine.compile.wanted`; compiled forwards by the tests that ask
for them (tests/engine/test_compiled.py). Engines built in this process see `auto` as
off; worker processes the tests start see `INFLIGHT_MODEL__COMPILE=off`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from worker.engine import compile as compile_rules

# the per-test timeout's dump of what a hung test waited on (tests/timeouts.py); pytester
# runs a pytest inside a test (tests/unit/test_timeouts.py); each test's CPU seconds listed at
# the end (tests/cpu_time.py)
pytest_plugins = ["tests.timeouts", "tests.cpu_time", "pytester"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (tools/test.sh: three worker processes on the 2-core box) the engines
# built in a worker process, and the scripts it starts (`OMP_NUM_THREADS`), compute with one
# torch thread: with torch's default of one per core, the OpenMP threads of three
# processes spun waiting for each other at every parallel region (the fair-share model
# test: 5.7 CPU-s alone, 20-33 CPU-s in the suite). Worker processes size their own
# threads (worker/engine/threads.py); a run without xdist keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

os.environ.setdefault("INFLIGHT_MODEL__COMPILE", "off")
compile_rules.AUTO_DEVICES = frozenset()

MODEL_CACHE = Path(os.environ.get("INFLIGHT_TEST_MODELS", Path(__file__).resolve().parents[1] / ".cache" / "test-models"))

# Tiny but real: GQA (4 query heads over 2 KV heads) for Llama/Qwen2, learned positions for GPT-2.
TINY = {
    "llama": dict(arch="llama", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, max_len=1024),
    "qwen2": dict(arch="qwen2", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, max_len=1024),
    "gpt2": dict(arch="gpt2", vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=4, max_len=1024),
}


def tiny_checkpoint(arch: str) -> Path:
    """Make (once, cached under .cache/test-models) and return a tiny checkpoint directory."""
    from tools.make_model import make_checkpoint

    spec = TINY[arch]
    out = MODEL_CACHE / f"tiny-{arch}-v1"
    if not (out / "model.safetensors").is_file():
        make_checkpoint(out, corpus_chars=400_000, log=lambda *_: None, **spec)
    return out


@pytest.fixture(autouse=True, scope="session")
def _linear_plans_of_this_session(tmp_path_factory):
    """`model.cpu_linear: auto` times its plans afresh in each test session and keeps them
    for it (`worker.model.linear_plans`), instead of reading the box's file of earlier
    runs (where the suite would time nothing, and a timing change would go untested)."""
    from worker.model import linear_plans

    path = tmp_path_factory.mktemp("linear-plans")
    real = linear_plans.plans_dir
    linear_plans.plans_dir = lambda: path
    yield
    linear_plans.plans_dir = real


# Files whose one test holds a core for minutes: collected first, so pytest-xdist's
# `--dist loadfile` (files handed out in collection order) starts them while the rest of
# the suite runs beside them, instead of last as a tail one worker runs alone (measured
# on a 2-core box: the gpu_check smoke, 250-310 s of one core, started last and ran alone
# for its last ~5 minutes of a 27-minute phase; 120 s alone since its engine runs stay
# under the split-K context, 268 s in the suite before that).
LONG_POLES = ("tests/kernels/test_gpu_check.py",)


def pytest_collection_modifyitems(config, items):
    """Tests under tests/integration need the dev stack: mark them `integration`, so
    `pytest -m "not integration"` runs everything that needs no services. `LONG_POLES`
    go first (a stable sort: everything else keeps its order)."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
    root = Path(config.rootpath)
    items.sort(key=lambda item: _relative(item.path, root) not in LONG_POLES)


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


@pytest.fixture
def one_torch_thread():
    """The test computes with one torch intra-op thread (restored after), as a worker's
    engine on a small box does (worker/engine/threads.py): with one thread per core, a
    core taken by anything else holds every OpenMP barrier of a step."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama_path() -> Path:
    return tiny_checkpoint("llama")


def draft_checkpoint(arch: str) -> Path:
    """A draft model for the tiny `arch` checkpoint (`speculative.method: draft`): the
    checkpoint with noise of 0.3 x each weight's std (tools/make_draft.py `--perturb`),
    so its guesses are often right and often wrong (made once, cached; a lock for
    pytest-xdist's workers)."""
    from filelock import FileLock

    from tools.make_draft import perturbed_copy

    out = MODEL_CACHE / f"tiny-{arch}-draft-v1"
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "model.safetensors").is_file():
            perturbed_copy(tiny_checkpoint(arch), out, sigma=0.3)
    return out


# The agent checkpoint is trained (tools/make_agent_model.py: 500 AdamW steps), which costs
# minutes, so it is cached per machine, outside the checkout, as Jaeger's build is
# (tools/stack/jaeger.sh): every clone on a machine shares it. The directory is named by a
# hash of the recipe's sources and torch's version, so a changed recipe trains anew.
AGENT_CACHE = Path(os.environ.get("INFLIGHT_AGENT_MODEL_CACHE", Path.home() / ".cache" / "inflight" / "agent-models"))
AGENT_RECIPE = ("tools/make_agent_model.py", "tools/make_model.py")


def agent_checkpoint() -> Path:
    """Make (once per machine and recipe, see `AGENT_CACHE`) and return the agent
    checkpoint: it reasons in <think> and calls tools in the Hermes format on its own.
    Training takes 90 s on the 2-core Intel box with AVX-512, 7.7 min on the 2-core AMD
    EPYC without it (both cores; under pytest-xdist one thread and two busy neighbours
    made it over 10 min, past a test's timeout), so tools/test.sh makes it before pytest
    starts; the fixture's own build (a test run by hand) pauses the test's timer. A lock:
    two processes may want it at once."""
    import hashlib
    import shutil

    from filelock import FileLock

    from tools.make_agent_model import make_agent_checkpoint

    root = Path(__file__).resolve().parents[1]
    recipe = hashlib.sha256(torch.__version__.encode())
    for name in AGENT_RECIPE:
        recipe.update((root / name).read_bytes())
    out = AGENT_CACHE / f"agent-tiny-{recipe.hexdigest()[:12]}"
    AGENT_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "model.safetensors").is_file():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            make_agent_checkpoint(tmp, log=lambda *_: None)
            tmp.rename(out)  # a build cut short leaves no checkpoint that looks whole
    return out


@pytest.fixture(scope="session")
def agent_path() -> Path:
    from tests.timeouts import paused

    with paused():  # a build here (a run by hand on a new machine) is not the test's time
        return agent_checkpoint()


@pytest.fixture(scope="session", params=["llama", "qwen2", "gpt2"])
def any_arch_path(request) -> Path:
    return tiny_checkpoint(request.param)


def arch_checkpoint(family: str) -> Path:
    """A tiny random-init checkpoint of one of tools.tiny_archs.NAMED_FAMILIES (made once,
    cached)."""
    from tools.tiny_archs import NAMED_FAMILIES, make_tiny

    model_type, overrides = NAMED_FAMILIES[family]
    out = MODEL_CACHE / "archs-v2" / family.replace(" ", "_").replace("(", "").replace(")", "")
    if not (out / "config.json").is_file():
        make_tiny(model_type, out, tiny_checkpoint("llama"), overrides)
    return out


def pytest_terminal_summary(terminalreporter):
    """The modules over the size to look at (tests/repo/test_code_shape.py: a list, not
    a failure; 600 lines fails)."""
    from tests.repo.test_code_shape import MODULE_WARN_LINES, module_sizes

    long = module_sizes(MODULE_WARN_LINES)
    if long:
        terminalreporter.section(f"modules over {MODULE_WARN_LINES} lines (look for a seam)", sep="-")
        for path, n in long.items():
            terminalreporter.line(f"{n:5d}  {path}")
