"""Structured outputs: a request's constraint (`params.structured`: JSON Schema, any JSON
object, regex, choice, Lark grammar) turned into a grammar, checked at input processing,
compiled off the step path, and applied to each step's logits as one bitmask of allowed
tokens (the design of vLLM's structured-output manager and of xgrammar / llguidance's
token-mask API; constrained decoding after Willard & Louf, "Efficient Guided Generation
for LLMs", 2023).

    input processing (front end, worker threads):
        constraint ──schemas.structured.grammar_of──► grammar text
                   ──GrammarValidator.check (model's tokenizer)──► EngineCoreRequest.grammar
    engine core (one thread + one compile thread):
        EngineCore._apply_queued ──GrammarCompiler.get──► Future[matcher]   (LRU cache by content)
        the request joins the scheduler once its matcher is ready (a step never waits for a compile)
        runner: masks.token_bitmask(matchers of the step's sampling rows) ──► sampler masks the logits
        Request.stop_status: the matcher consumes every token the request keeps; grammar done = stop

The library is llguidance (Rust core, Python bindings; vLLM's and TensorRT-LLM's
second backend), chosen over xgrammar by `tools/bench/structured.py` (docs/engine.md,
docs/benchmarks.md): it compiles a 10-field schema in ~1.4 ms (xgrammar ~6 ms) and shares
it by deep copy, implements the schema keywords xgrammar ignores (`multipleOf` on
numbers) or refuses the schema, drops the GIL while it builds a grammar and fills masks,
and takes JSON Schema, regex and Lark through one API without torch. xgrammar's masks are
faster per row (~0.2 vs ~0.8 ms at 64 rows here).

Masks are computed from the matchers' state after the previous token, so they are valid for
recompute after preemption (the matcher only ever holds the request's kept output tokens:
nothing is consumed speculatively, and a dropped in-flight token is never consumed).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from schemas.params import StructuredOutput
from schemas.structured import StructuredOutputError, grammar_of
from worker.engine.closing import ClosingPlan, ClosingTable


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> Any:
    """An `llguidance.LLTokenizer` for a transformers fast tokenizer (ids up to the
    model's `vocab_size`; padded ids past the tokenizer's are never allowed).

    Raises:
        StructuredOutputError: the tokenizer is not one llguidance can read (a slow
            tokenizer, a toy tokenizer of the model-less engine).
    """
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                            eos_token=sorted(eos_token_ids) or None)
    except Exception as e:  # the library raises ValueError / its own errors
        raise StructuredOutputError(f"the model's tokenizer cannot serve structured outputs ({e})") from None


class _LazyTokenizer:
    """Builds the LLTokenizer on first use (it costs up to ~1 s for a large vocabulary);
    a tokenizer that cannot be read is remembered as the error every later call raises."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._tok: Any = None
        self._error: StructuredOutputError | None = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._tok is None and self._error is None:
                try:
                    self._tok = ll_tokenizer(*self._args)
                except StructuredOutputError as e:
                    self._error = e
            if self._error is not None:
                raise self._error
            return self._tok


class GrammarValidator:
    """Input processing's check of constraints (front end; any thread).

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's vocabulary (logit rows).
        eos_token_ids: ids that end generation.
        max_bytes: `serving_tuning.max_structured_output_bytes`.
        cache_size: grammars whose verdict is kept (by grammar text).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], *, max_bytes: int,
                 cache_size: int = 1024) -> None:
        self._tok = _LazyTokenizer(tokenizer, vocab_size, eos_token_ids)
        self.max_bytes = max_bytes
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # grammar -> "" (valid) or the error
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def check(self, c: StructuredOutput) -> str:
        """The grammar text of `c`, valid for this model's tokenizer.

        Raises:
            StructuredOutputError: with the library's message.
        """
        from llguidance import LLMatcher

        grammar = grammar_of(c, self.max_bytes)
        with self._lock:
            verdict = self._verdicts.get(grammar)
            if verdict is not None:
                self._verdicts.move_to_end(grammar)
        if verdict is None:
            verdict = LLMatcher.validate_grammar(grammar, self._tok.get())
            with self._lock:
                self._verdicts[grammar] = verdict
                while len(self._verdicts) > self._cache_size:
                    self._verdicts.popitem(last=False)
        if verdict:
            raise StructuredOutputError(verdict.strip())
        return grammar


class GrammarCompiler:
    """The engine core's compiled grammars: one compile thread, an LRU cache of matchers
    in their start state by grammar text (each request gets a deep copy, ~10 µs).

    Args:
        tokenizer, vocab_size, eos_token_ids: as `GrammarValidator`.
        cache_size: `serving_tuning.grammar_cache_size`.

    Counters (`hits`, `misses`, `compile_s`) are read and reset by `take_stats`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], *,
                 cache_size: int = 1024, closing: bool = True) -> None:
        self._tok = _LazyTokenizer(tokenizer, vocab_size, eos_token_ids)
        self._closing_args = (tokenizer, vocab_size, eos_token_ids) if closing else None
        self.closing_table: ClosingTable | None = None  # built with the first compile (`closing`)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0
        self.compile_s: list[float] = []
        self._stats_lock = threading.Lock()

    def get(self, grammar: str) -> Future:
        """A future of the start-state matcher of `grammar` (cached, or compiling now);
        its exception is a `StructuredOutputError`. Call from the core's thread."""
        fut = self._cache.get(grammar)
        if fut is not None:
            self._cache.move_to_end(grammar)
            self.hits += 1
            return fut
        self.misses += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-grammar")
        fut = self._pool.submit(self._compile, grammar)
        self._cache[grammar] = fut
        while len(self._cache) > self._cache_size:
            old, f = next(iter(self._cache.items()))
            if not f.done():
                break
            del self._cache[old]
        return fut

    def _compile(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        t0 = time.perf_counter()
        if self._closing_args is not None and self.closing_table is None:  # (the compile thread only)
            self.closing_table = ClosingTable.of_tokenizer(*self._closing_args)
        m = LLMatcher(self._tok.get(), grammar, log_level=0)  # drops the GIL while it builds
        with self._stats_lock:
            self.compile_s.append(time.perf_counter() - t0)
        if m.is_error():
            raise StructuredOutputError(m.get_error().strip())
        return m

    def take_stats(self) -> tuple[int, int, list[float]]:
        """(cache hits, cache misses, compile seconds) since the last call."""
        with self._stats_lock:
            out = (self.hits, self.misses, self.compile_s)
            self.hits, self.misses, self.compile_s = 0, 0, []
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class PendingGrammars:
    """Requests waiting for their grammar to compile (the engine core's thread).

    Args:
        compiler: the core's `GrammarCompiler`; None: every request ends with an error
            ("no grammar compiler").
    """

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self._waiting: dict[str, tuple[Future | None, Any]] = {}  # request id -> (matcher future, request)
        self._any_seen = False  # a constrained request came: the stats count them from then on

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, r: Any) -> None:
        """Start (or find cached) the grammar of `r` (an EngineCoreRequest with `grammar`)."""
        self._any_seen = True
        self._waiting[r.request_id] = (self.compiler.get(r.grammar) if self.compiler else None, r)

    def pop(self, request_id: str) -> Any | None:
        """Stop waiting for `request_id`; its request, or None if it was not waiting."""
        entry = self._waiting.pop(request_id, None)
        return entry[1] if entry is not None else None

    def take_ready(self) -> list[tuple[Any, Matcher | None, str]]:
        """(request, its matcher in the start state or None, the compile error or "") of
        every request whose grammar is done, in arrival order."""
        out = []
        for rid, (fut, r) in list(self._waiting.items()):
            if fut is not None and not fut.done():
                continue
            del self._waiting[rid]
            if fut is None:
                out.append((r, None, "this engine has no grammar compiler"))
                continue
            try:
                out.append((r, Matcher(fut.result().deep_copy(), self.compiler.closing_table), ""))
            except Exception as e:  # StructuredOutputError, or the library's own
                out.append((r, None, str(e)))
        return out

    def stats(self, requests: Any) -> tuple[int, int, list[float], int]:
        """(grammar cache hits, misses, compile seconds since the last call, constrained
        requests: waiting here or among `requests`); zeros until a constrained request came."""
        if not self._any_seen or self.compiler is None:
            return 0, 0, [], len(self._waiting)
        hits, misses, compile_s = self.compiler.take_stats()
        return hits, misses, compile_s, len(self._waiting) + sum(1 for r in requests if r.grammar is not None)

    def wait(self, timeout_s: float) -> None:
        """Block until one grammar is done or `timeout_s` passed (when there is nothing
        else to run, instead of spinning)."""
        futures = [f for f, _ in self._waiting.values() if f is not None]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)


class Matcher:
    """One request's grammar state (an llguidance `LLMatcher`).

    `accept(token_id)` advances it by a kept token and returns False when the token was
    not allowed (then `error` says why); `done` is True once the output is complete and
    nothing may follow. `closing`: the table budget-aware closing reads (None: off)."""

    __slots__ = ("_m", "closing", "closing_plan", "error")

    def __init__(self, matcher: Any, closing: ClosingTable | None = None) -> None:
        self._m = matcher
        self.closing = closing
        self.closing_plan = ClosingPlan()  # when closing looks again, and the way it is following
        self.error = ""

    def accept(self, token_id: int) -> bool:
        if self._m.consume_token(token_id):
            return True
        self.error = self._m.get_error().strip() or f"token {token_id} not allowed"
        return False

    @property
    def done(self) -> bool:
        return self._m.is_stopped()

    @property
    def raw(self) -> Any:
        return self._m
