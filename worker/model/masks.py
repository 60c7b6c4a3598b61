"""Token masks of structured outputs on the device: the allowed next tokens of each
constrained row, filled by llguidance from the grammar matchers
(`worker.engine.structured.Matcher`, whose grammar side needs no torch) and unpacked
where the logits are.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from worker.engine.closing import narrow

if TYPE_CHECKING:
    from worker.engine.structured import Matcher

_EXECUTOR: Any = None
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _parallel_fill(device: torch.device) -> bool:
    """Fill rows on llguidance's executor threads only where cores are left beside
    torch's: on a CPU engine torch's OpenMP team spins on every core right after the
    forward, and the executor's threads then measured 1.6x slower than one thread
    filling every row (2.1 vs 1.3 ms at 64 rows, docs/benchmarks.md)."""
    return device.type == "cuda" or _usable_cpus() > torch.get_num_threads() + 1


def fill_beside_forward(device: torch.device) -> bool:
    """Whether a step's masks are filled on a thread of their own while the forward runs
    (`start_token_bitmask`, the runner decides before the forward): on CUDA, where the
    forward thread mostly waits for the device; on the CPU only where torch's intra-op
    threads leave a core this process may use, as in an engine process under the worker's
    thread budget (`worker.engine.threads`): there, 64 constrained rows cost +6 to +15% step
    time against +15 to +17% filled after the forward; beside an OpenMP team on every core
    (an engine alone with torch's default threads) the thread measured +18-34%
    (docs/benchmarks.md#structured-outputs)."""
    return device.type == "cuda" or torch.get_num_threads() < _usable_cpus()


@functools.cache
def _usable_cpus() -> int:
    """`worker.engine.threads.usable_cpus`, read once (affinity and cgroup files); the
    thread count it is compared with is read at every step (the budget may change it)."""
    from worker.engine.threads import usable_cpus

    return usable_cpus()


def remaining_budget(r: Any) -> int | None:
    """Output tokens a sampling row's request may still generate, the sampled one included
    (None: no limit that closing would honour: no `max_tokens`, or `ignore_eos`)."""
    p = r.params
    if p.max_tokens is None or p.ignore_eos:
        return None
    return p.max_tokens - (r.start_pos + r.num_tokens - r.num_prompt_tokens)


def token_bitmask(matchers: list[Matcher], vocab_size: int, device: torch.device,
                  ahead: list[list[int]] | None = None, remaining: list[int | None] | None = None) -> torch.Tensor:
    """Allowed next tokens of each matcher: bool `[len(matchers), vocab_size]` on `device`.
    `ahead[i]`: tokens row i's mask comes after (a speculating decode's guesses before
    its position): consumed, the mask filled, rolled back (one row at a time then, since
    rows share their request's matcher). `remaining[i]`: row i's output tokens left
    (`remaining_budget`): a row near its limit is narrowed towards its grammar's end
    (`worker.engine.closing`).

    One int32 bitmask (`[rows, ceil(vocab/32)]`, bit j of word w = token 32w + j) filled
    by llguidance with the GIL released (on its executor's threads where spare cores
    exist: `_parallel_fill`), then unpacked: on the CPU by numpy, on CUDA on the device
    after a copy of vocab/8 bytes per row (the unpacked mask would be 8x larger).
    """
    global _EXECUTOR
    import llguidance
    import llguidance.numpy as lln

    n = len(matchers)
    words = (vocab_size + 31) // 32
    bitmask = np.full((n, words), -1, dtype=np.int32)
    # row i at base + i * row_bytes: llguidance's own fill without its wrapper's per-row
    # checks and slicing (~2 us a row, a fifth of a fill; the array is made right above)
    base, row_bytes = bitmask.ctypes.data, words * 4
    left = remaining if remaining is not None else [None] * n
    if ahead is not None and any(ahead):
        for i, (m, guesses) in enumerate(zip(matchers, ahead)):
            if guesses and not m.raw.consume_tokens(guesses):  # the proposer validated them: a broken invariant
                raise RuntimeError(f"a verified row's guesses {guesses} are not allowed by its grammar")
            m.raw.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
            if m.closing is not None and left[i] is not None:
                narrow(m.raw, m.closing, left[i], bitmask, i, m.closing_plan)
            if guesses:
                m.raw.rollback(len(guesses))
    elif n > 1 and _parallel_fill(device):
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        lln.fill_next_token_bitmask_par(_EXECUTOR, [(m.raw, i) for i, m in enumerate(matchers)], bitmask)
    else:
        for i, m in enumerate(matchers):
            m.raw.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
    if ahead is None or not any(ahead):
        for i, m in enumerate(matchers):
            if m.closing is not None and left[i] is not None:
                narrow(m.raw, m.closing, left[i], bitmask, i, m.closing_plan)
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits).bool()
    return unpack_on_device(bitmask, vocab_size, device)


_MASK_THREAD: ThreadPoolExecutor | None = None


def start_token_bitmask(reqs: list[Any], vocab_size: int, device: torch.device) -> Future | None:
    """`token_bitmask` of the constrained rows of `reqs` (ScheduledRequests that sample),
    started on a thread of its own so it runs while the forward does (the runner calls
    this before the forward; llguidance drops the GIL while it fills, torch inside its
    kernels). Resolves to (bool `[rows with a grammar, vocab_size]`, seconds it took);
    None when no row has a grammar."""
    global _MASK_THREAD
    matchers = [r.grammar for r in reqs if r.grammar is not None]
    if not matchers:
        return None
    ahead = [r.ahead for r in reqs if r.grammar is not None]
    remaining = [remaining_budget(r) for r in reqs if r.grammar is not None]
    if _MASK_THREAD is None:
        _MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-mask")

    def run() -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        allowed = token_bitmask(matchers, vocab_size, device, ahead, remaining)
        return allowed, time.perf_counter() - t0

    return _MASK_THREAD.submit(run)


def unpack_on_device(bitmask: np.ndarray, vocab_size: int, device: torch.device) -> torch.Tensor:
    """`[rows, words]` int32 bitmask -> bool `[rows, vocab_size]` on `device` (the copy is
    the packed mask; bits are expanded there)."""
    n, words = bitmask.shape
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    packed = torch.from_numpy(bitmask).to(device, non_blocking=True)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(n, words * 32)[:, :vocab_size].bool()
