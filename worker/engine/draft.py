"""Draft-model guesses for speculative decoding (`serving_tuning.speculative.method:
draft`): a small checkpoint with the model's tokenizer guesses each speculating decode's
next k tokens greedily, one forward of it per guess, batched over the step's
speculating requests (Leviathan et al., ICML 2023; Chen et al. 2023; vLLM's
`draft_model` method). The model's forward then verifies the guesses as it verifies
any draft (speculative.py): the tokens are the model's whatever the draft model says.

**Its KV cache** is a second `ModelRunner` over the draft model with as many blocks as the
model's, read through the same block tables: a request's draft KV sits in the blocks the
scheduler gave the request, so it is counted in the same token budget, freed on finish
and cancel, and lost on preemption with the request's own (`kv_cache_blocks` sizes the
blocks for both models' bytes per token). Order within a step:

    schedule      a decode that drafts gets k `DRAFT_PENDING` guesses, and blocks for its
                  1 + k positions L-1 .. L-1+k (L: its known tokens)
    fill          the draft model is fed the request's tokens its cache does not hold
                  yet (up to position L-1: its first guess d_1), then d_1 .. d_{k-1} at
                  L .. L+k-2, one forward each (the guesses d_2 .. d_k): every position it
                  writes lies in the blocks the step already holds
    forward       the model verifies [t_{L-1}, d_1 .. d_k]

Which positions of a request's draft cache hold its real tokens (`SpecState`): up to
`draft_valid` after its last fill, then the guesses it was fed (`draft_fed`) as far as
they equal the tokens the request went on with (the kept guesses); a preemption since
(it freed the blocks) or a new request (its prefix-cache blocks may hold another
request's draft KV, or none) starts from 0, so the first fill of a request is a prefill
of its whole context on the draft model. A guess at or above the model's vocabulary
ends the draft there; a structured output's draft ends at the first guess its grammar
refuses; a request whose draft would pass the draft model's context is not drafted.
The draft model runs without LoRA adapters: a LoRA request drafts with the base draft
and verifies with its adapter.

A fill that raises (out of memory included) costs the step its guesses, not its
requests: they decode plainly, and the error is logged (the first, then every 100th).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.params import SamplingParams
from worker.engine.compile import one_line, warm_up
from worker.engine.outputs import ScheduledRequest, SchedulerOutput
from worker.engine.speculative import DRAFT_PENDING, SpecState

if TYPE_CHECKING:
    from worker.config import ModelConfig, SpeculativeConfig
    from worker.model.loader import LoadedModel

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


class Drafter:
    """Fills the pending drafts of a scheduled step with the draft model's guesses.

    Args:
        runner: a `ModelRunner` over the draft model, with the engine's number of blocks
            and block size: its `greedy_steps` make the guesses (one forward per guess,
            no sampler).
        vocab_size: the model's vocabulary (logit rows): guesses from here on are cut.
        max_model_len: the draft model's context, tokens.
    """

    def __init__(self, runner, vocab_size: int, max_model_len: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_forwards = 0
        self.num_tokens_fed = 0
        self.num_failures = 0
        self.seconds = 0.0  # spent in fills, wall seconds

    def compile(self, generate, artifacts: Path | None = None) -> str:
        """Run the draft model's forward compiled (`ModelRunner.compile`, as the model's is
        with `model.compile`), its graph built by the engine's warm-up requests through
        `generate` (`Engine.generate`; they draft): captured ahead of time under
        `artifacts` (or loaded from there) as the model's is with `model.precompile`,
        whose calls skip Dynamo's per-call work (a third of a guess on the CPU bench
        draft); None: `torch.compile`. Never raises: a draft model that does not compile
        stays eager. Returns how its forward runs, in words."""
        runner = self.runner
        try:
            runner.compile(artifacts)
            warm_up(generate)
            if runner.compile_error is not None:
                raise runner.compile_error
            runner.forward_fn.warm = True  # the graph is built: no more guard checks
        except Exception as e:
            runner.uncompile()
            why = one_line(e)
            log.warning("the draft model's forward stays eager: compiling it failed (%s)", why)
            return f"eager (compiling failed: {why})"
        return "compiled"

    def capture_graphs(self, max_batch: int, max_model_len: int, replay: str, generate) -> str:
        """Capture the draft model's decode graphs (`ModelRunner.capture_graphs`, as the
        model's are with `model.cuda_graphs`): its guesses after the first are one-token
        decodes of the step's speculating requests, replayed from graphs for batches up to
        `max_batch`; exercised through `generate` (`Engine.generate`). Never raises: a
        draft model that does not capture runs its forward. Returns what happened, in words."""
        try:
            graphs = self.runner.capture_graphs(max_batch, min(max_model_len, self.max_model_len), replay)
            warm_up(generate)
        except Exception as e:
            self.runner.drop_graphs()
            why = one_line(e)
            log.warning("the draft model's decode steps run without graphs: capturing failed (%s)", why)
            return f"no decode graphs (capturing failed: {why})"
        return f"decode graphs for batches of 1-{graphs.sizes[-1]}"

    def fill(self, sched: SchedulerOutput) -> None:
        """Replace each pending draft of `sched` by the draft model's guesses (fewer, or
        none, where a rule of the module docstring cuts them); the step's token count and
        each request's progress follow its chunk."""
        pending = [(s, req) for s, req in zip(sched.scheduled, sched.requests)
                   if s.draft and s.draft[0] == DRAFT_PENDING]
        if not pending:
            return
        t0 = time.perf_counter()
        try:
            guesses = self._guess(pending, sched.step)
        except Exception as e:  # the step decodes plainly; its requests are not at fault
            self.num_failures += 1
            if self.num_failures % 100 == 1:
                log.error("the draft model failed (%s); this step decodes without guesses (%d failures so far)",
                          one_line(e), self.num_failures)
            guesses = {}
            for _, req in pending:
                if req.spec is not None:
                    req.spec.draft_valid, req.spec.draft_fed = 0, []  # what it wrote is unknown: start over
        for s, req in pending:
            draft = guesses.get(s.request_id, [])
            if s.grammar is not None and draft:
                draft = draft[: s.grammar.raw.validate_tokens(draft)]
            cut = len(s.draft) - len(draft)
            sched.num_scheduled_tokens -= cut
            sched.num_spec_tokens -= cut  # its last token stays a decode position
            s.draft = draft
            s.token_ids = [s.token_ids[0], *draft]
            req.num_computed_tokens = s.start_pos + len(s.token_ids)
        self.seconds += time.perf_counter() - t0

    def _guess(self, pending: list, step: int) -> dict[str, list[int]]:
        """The greedy guesses of each pending request, by request id."""
        wanted: dict[str, int] = {}
        rows: list[ScheduledRequest] = []
        for s, req in pending:
            known = s.start_pos + 1  # a decode's chunk starts at its last known token
            k = len(s.draft)
            if known + k > self.max_model_len:
                continue
            state = req.spec if req.spec is not None else SpecState()
            req.spec = state
            tokens = s.all_token_ids[:known]
            valid = 0
            if state.draft_preemptions == req.num_preemptions:
                valid = state.draft_valid
                for fed, token in zip(state.draft_fed, tokens[valid:]):
                    if fed != token:
                        break
                    valid += 1
            start = min(valid, known - 1)
            state.draft_valid, state.draft_fed, state.draft_preemptions = known, [], req.num_preemptions
            wanted[s.request_id] = k
            rows.append(ScheduledRequest(s.request_id, tokens[start:], start, s.block_ids, True, GREEDY, tokens))
        out: dict[str, list[int]] = {rid: [] for rid in wanted}
        states = {s.request_id: req.spec for s, req in pending}
        while rows:  # rounds of as many forwards as every row still wants (all of them, when k is the same)
            steps = min(wanted[r.request_id] - len(out[r.request_id]) for r in rows)
            guessed = self.runner.greedy_steps(rows, steps, step)
            self.num_forwards += steps
            self.num_tokens_fed += sum(len(r.token_ids) for r in rows) + (steps - 1) * len(rows)
            feed = []
            for row in rows:
                rid, guesses = row.request_id, guessed[row.request_id]
                kept = 0
                for guess in guesses:
                    if guess >= self.vocab_size:  # the model cannot read it: the draft ends before it
                        break
                    out[rid].append(guess)
                    kept += 1
                    if len(out[rid]) == wanted[rid]:
                        break
                    states[rid].draft_fed.append(guess)  # fed to the draft model, in this round or the next
                if kept == steps and len(out[rid]) < wanted[rid]:
                    feed.append(ScheduledRequest(rid, [guesses[-1]], row.start_pos + len(row.token_ids) + steps - 1,
                                                 row.block_ids, True, GREEDY, []))
            rows = feed
        return out


def load_draft(spec: SpeculativeConfig, model_cfg: ModelConfig, loaded: LoadedModel) -> LoadedModel:
    """The draft checkpoint `spec.draft_model` (`SpeculativeConfig`), loaded on the model's
    device and dtype (`ModelConfig` `model_cfg`), without adapters, quantization or a
    compiled forward; `loaded` is the model (`LoadedModel`) it must share a tokenizer with.

    Raises:
        ConfigError: naming `serving_tuning.speculative.draft_model`: not a checkpoint
            directory, a model the engine cannot serve, a tokenizer other than the model's,
            or a sliding-window KV cache (its blocks are freed behind the window).
    """
    import msgspec

    from worker.config import ConfigError
    from worker.model.loader import load_model

    field = "serving_tuning.speculative.draft_model"
    cfg = msgspec.structs.replace(model_cfg, path=spec.draft_model, max_model_len=None, lora_dir=None,
                                  quantization="none", compile="off")
    try:
        draft = load_model(cfg)
    except (FileNotFoundError, PermissionError, ValueError) as e:
        raise ConfigError(f"{field} {spec.draft_model!r}: {str(e).replace('model.path', 'path')}") from None
    if draft.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise ConfigError(f"{field} {spec.draft_model!r}: its tokenizer is not the model's ({len(draft.tokenizer)} "
                          f"vs {len(loaded.tokenizer)} tokens, or the same size with other pieces); a draft model "
                          "must share the model's tokenizer")
    if draft.kv_layout.sliding_window is not None:
        raise ConfigError(f"{field} {spec.draft_model!r}: a sliding-window model cannot be a draft model here")
    log.info("draft model %s loaded (%d layers, %s)", spec.draft_model, draft.num_layers, draft.verdict())
    return draft
