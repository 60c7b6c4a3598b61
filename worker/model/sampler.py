"""Token sampling for a batch with per-request parameters, in one vectorized pass.

Order: structured-output masks (rows with a grammar: tokens it does not allow get -inf) →
logit bias → repetition penalty (CTRL / transformers semantics) → presence and frequency
penalties (OpenAI / vLLM semantics, over the output) → greedy argmax for temperature 0 →
temperature → top-k → top-p → min-p → sample. The filters keep or drop
tied logits together (rules in `_filter`), matching transformers' warpers. Sampling uses the
exponential race (argmax of p / E with E ~ Exp(1)), so each row's randomness comes
only from its own generator: a seeded request draws the same tokens whatever else
is in the batch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from worker.engine.outputs import ScheduledRequest, TokenLogprobs
from worker.engine.speculative import num_accepted


def sample(logits: torch.Tensor, reqs: list[ScheduledRequest], timing: dict[str, float] | None = None,
           masks: Future | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample_on_device` with the ids copied to the host: `(token ids, logprobs)`."""
    token_ids, logprobs = sample_on_device(logits, reqs, timing, masks)
    return token_ids.tolist(), logprobs


def sample_on_device(logits: torch.Tensor, reqs: list[ScheduledRequest], timing: dict[str, float] | None = None,
                     masks: Future | None = None, generator_states: dict[int, torch.Tensor | None] | None = None,
                     ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
    """Sample one token per row; the ids stay on the logits' device (no sync unless a row
    asks for logprobs).

    Args:
        logits: `[num_reqs, vocab_size]` raw model logits (any float dtype).
        reqs: the scheduled requests, one per row, carrying params / generator /
            all_token_ids / grammar.
        timing: if given, `timing["mask_s"]` is set to the seconds spent on structured-output
            masks (computing the step's bitmask and applying it).
        masks: the step's masks started before the forward (`worker.model.masks.start_token_bitmask`
            for these `reqs`); None: computed here.
        generator_states: rows (keys) of seeded sampled requests whose generator state
            just after their row's draw is wanted: filled in (a speculating request's
            verification winds its generator back to its last kept draw). Rows of one
            generator draw in row order.

    Returns:
        (token ids `[num_reqs]` int64 on the logits' device, per-row TokenLogprobs or
        None where `params.logprobs` is None).
        Logprobs are taken from the model's distribution before penalties and
        temperature; for a row with a grammar, from that distribution renormalized over
        the tokens the grammar allows (the masked distribution, as vLLM reports it).
    """
    logits = logits.float()
    params = [r.params for r in reqs]
    if any(r.grammar is not None for r in reqs):
        logits = _mask_grammars(logits, reqs, masks, timing)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    if any(p.logit_bias for p in params):
        logits = _apply_logit_bias(logits, params)
    penalties = [p.repetition_penalty for p in params]
    if any(x != 1.0 for x in penalties):
        logits = _apply_repetition_penalty(logits, reqs, penalties)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        logits = _apply_output_penalties(logits, reqs, params)
    token_ids = _draw(logits, reqs, params, generator_states)
    if raw_logprobs is None:
        return token_ids, [None] * len(reqs)
    return token_ids, _logprobs(raw_logprobs, token_ids, reqs, params)


def verify_drafts(logits: torch.Tensor, reqs: list[ScheduledRequest], rows: list[ScheduledRequest],
                  timing: dict[str, float], masks: Future | None
                  ) -> tuple[torch.Tensor, list[TokenLogprobs | None], list[tuple[int, int]]]:
    """Sample a step with speculating decodes and keep, per speculating request, the
    tokens its draft's verification accepts (`worker.engine.speculative`).

    Args:
        logits: `[len(rows), vocab_size]`, a row per sampled position.
        reqs: the step's requests that sample, in row order; `rows`: their rows (a
            speculating decode's `verify_rows`, one row for the others).

    Returns:
        (token ids `[len(rows)]` on the logits' device, per-row logprobs, per request the
        first row and how many tokens it keeps). A seeded request's generator is wound
        back to just after its last kept draw; the ids come to the host here (the
        acceptance decides what the step returns).
    """
    states: dict[int, torch.Tensor | None] = {}
    r = 0
    for s in reqs:
        if s.draft and s.generator is not None and s.params.temperature != 0.0:
            states.update((row, None) for row in range(r, r + s.num_rows))
        r += s.num_rows
    token_ids, logprobs = sample_on_device(logits, rows, timing, masks, generator_states=states)
    ids = token_ids.tolist()
    spans: list[tuple[int, int]] = []
    r = 0
    for s in reqs:
        n = 1 + num_accepted(ids[r: r + len(s.draft)], s.draft) if s.draft else 1
        if r + n - 1 in states:
            s.generator.set_state(states[r + n - 1])
        spans.append((r, n))
        r += s.num_rows
    return token_ids, logprobs, spans


def _mask_grammars(logits: torch.Tensor, reqs: list[ScheduledRequest], masks: Future | None,
                   timing: dict[str, float] | None) -> torch.Tensor:
    """`logits` `[num_reqs, vocab]` with every token its row's grammar forbids at -inf
    (rows without a grammar unchanged); the masks' seconds into `timing["mask_s"]`."""
    from worker.model.masks import remaining_budget, token_bitmask

    n, vocab = logits.shape
    grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    fill_s = 0.0  # the fill's own time on the mask thread (hidden behind the forward or not)
    allowed = None
    if masks is not None:
        allowed, fill_s = masks.result()
        if allowed.shape != (len(grammar_rows), vocab):  # the runner guessed the vocabulary wrong
            allowed = None
    t1 = time.perf_counter()
    if allowed is None:
        allowed = token_bitmask([reqs[i].grammar for i in grammar_rows], vocab, logits.device,
                                [reqs[i].ahead for i in grammar_rows],
                                [remaining_budget(reqs[i]) for i in grammar_rows])
    if len(grammar_rows) == n:
        logits = logits.masked_fill(~allowed, float("-inf"))
    else:
        rows = torch.tensor(grammar_rows, device=logits.device)
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if timing is not None:
        timing["mask_s"] = fill_s + (time.perf_counter() - t1)
    return logits


def _draw(logits: torch.Tensor, reqs: list[ScheduledRequest], params: list,
          states: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
    """One token id per row `[num_reqs]` on the logits' device: argmax where the
    temperature is 0; else temperature, top-k / top-p / min-p, and an exponential race
    (Gumbel-max) drawn from the row's own generator when seeded, so a seeded row draws
    the same whatever else is in the batch. `states`: rows whose generator state after
    their draw is recorded into it (`sample_on_device`'s `generator_states`)."""
    n, vocab = logits.shape
    device = logits.device
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if len(greedy_rows) == n:  # every row greedy: no index to build
        return logits.argmax(dim=-1)
    token_ids = torch.empty(n, dtype=torch.long, device=device)
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        token_ids[rows] = logits[rows].argmax(dim=-1)
    sample_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if sample_rows:
        rows = torch.tensor(sample_rows, device=device)
        sp = [params[i] for i in sample_rows]
        x = logits[rows] / torch.tensor([p.temperature for p in sp], device=device).unsqueeze(1)
        x = _filter(x, sp)
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(sample_rows) if reqs[i].generator is not None]
        unseeded = [j for j, i in enumerate(sample_rows) if reqs[i].generator is None]
        for j in seeded:
            generator = reqs[sample_rows[j]].generator
            _exponential(noise[j], generator)
            if states and sample_rows[j] in states:
                states[sample_rows[j]] = generator.get_state()
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            noise[idx] = _exponential(torch.empty(len(unseeded), vocab, device=device))
        token_ids[rows] = (probs / noise).argmax(dim=-1)
    return token_ids


def _exponential(out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill `out` with Exp(1) draws from `generator` (None: the default one) and return it.
    On the CPU: -log U for U uniform on [tiny, 1) (`tiny` the smallest normal float: a draw
    is never 0, which would make its token win whatever its probability, and at most 87.3,
    past which Exp(1) has e^-87 of its mass): torch's `exponential_` costs 19 ns an element
    there against 5 ns this way (39 vs 10 us a row for a vocabulary of 2048; sampling 64
    rows 2.2-3.2x faster at vocabularies of 2k to 128k, measured on the 2-core benchmark
    box). Elsewhere `exponential_`: one kernel where this would launch three (a seeded row
    draws alone)."""
    if out.device.type != "cpu":
        return out.exponential_(generator=generator)
    return out.uniform_(torch.finfo(out.dtype).tiny, 1.0, generator=generator).log_().neg_()


def _logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, reqs: list[ScheduledRequest],
              params: list) -> list[TokenLogprobs | None]:
    """Per row: the drawn token's logprob and the top `params.logprobs` (None where not
    asked), from `raw_logprobs` `[num_reqs, vocab]` (before penalties and temperature)."""
    out: list[TokenLogprobs | None] = [None] * len(reqs)
    ids = token_ids.tolist()
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        row = raw_logprobs[i]
        top_vals, top_ids = row.topk(p.logprobs) if p.logprobs > 0 else (row[:0], row[:0].long())
        if reqs[i].grammar is not None:  # fewer allowed tokens than asked for: no -inf entries
            keep = top_vals > float("-inf")
            top_vals, top_ids = top_vals[keep], top_ids[keep]
        out[i] = TokenLogprobs(token_id=ids[i], logprob=float(row[ids[i]]), top_token_ids=top_ids.tolist(),
                               top_logprobs=top_vals.tolist())
    return out


def _apply_repetition_penalty(
    logits: torch.Tensor, reqs: list[ScheduledRequest], penalties: list[float]
) -> torch.Tensor:
    """Penalize every token already in the prompt or output: logit / p if > 0 else logit * p."""
    n, vocab = logits.shape
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
    for i, r in enumerate(reqs):
        if penalties[i] != 1.0 and r.all_token_ids:
            seen[i, torch.tensor(r.all_token_ids, device=logits.device)] = True
    pen = torch.tensor(penalties, device=logits.device).unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(seen, penalized, logits)


def _apply_logit_bias(logits: torch.Tensor, params: list) -> torch.Tensor:
    """`logits` `[num_reqs, vocab]` plus each row's `logit_bias` at its token ids (the
    input processor rejected ids outside the vocabulary)."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            vals.append(bias)
    bias = torch.zeros_like(logits)
    bias[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = torch.tensor(
        vals, dtype=logits.dtype, device=logits.device)
    return logits + bias


def _apply_output_penalties(logits: torch.Tensor, reqs: list[ScheduledRequest], params: list) -> torch.Tensor:
    """Presence and frequency penalties over each row's output so far (not its prompt):
    `logit - frequency * count - presence * (count > 0)` (OpenAI's formula, vLLM's scope)."""
    n, vocab = logits.shape
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=logits.device)
    for i, r in enumerate(reqs):
        output = r.all_token_ids[r.num_prompt_tokens:]
        if output and (params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0):
            ids = torch.tensor(output, device=logits.device)
            counts[i].index_add_(0, ids, torch.ones(len(output), dtype=logits.dtype, device=logits.device))
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=logits.device)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=logits.device)
    return logits - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _filter(x: torch.Tensor, params: list) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p (transformers' warper order) as -inf masks.

    x: `[rows, vocab]` temperature-scaled logits; one row per request, mixed params.

    Ties: each filter is a threshold on the logit, so tokens of equal logit are kept or
    dropped together and the result never depends on how a sort orders them:
      - top-k keeps every token whose logit is >= the k-th largest (as transformers'
        TopKLogitsWarper; more than k tokens when the k-th value is tied);
      - top-p keeps a token iff the probability mass of tokens *strictly* more likely
        than it is < top_p (same as transformers' TopPLogitsWarper, which keeps a token
        iff the mass above it in its sort order is < top_p, whenever no tie group
        straddles the cut; when one does, transformers keeps a sort-order-dependent
        part of that group and we keep all of it);
      - min-p keeps tokens with p >= min_p * p_max (as transformers' MinPLogitsWarper).
    """
    rows, vocab = x.shape
    device = x.device
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_x = x.sort(dim=-1, descending=True).values
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device).unsqueeze(1)
        kth = sorted_x.gather(1, k - 1)  # [rows, 1]
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            probs = torch.softmax(sorted_x, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens sorted before each one
            p = torch.tensor(top_p, device=device).unsqueeze(1)
            num_keep = (mass_before < p).sum(dim=-1, keepdim=True).clamp(min=1)  # mass_before is sorted
            num_keep = torch.where(p >= 1.0, vocab, num_keep)
            x = x.masked_fill(x < sorted_x.gather(1, num_keep - 1), float("-inf"))
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(x, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device).unsqueeze(1)
        x = x.masked_fill(probs < threshold, float("-inf"))
    return x
