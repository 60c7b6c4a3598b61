"""Refusing at the edge what the edge can judge: a request whose prompt cannot fit the
model's context is answered 400 `context_length_exceeded` by the gateway itself, before
anything is produced, instead of going through Kafka to a worker that rejects it (a DLQ
record and, before the DLQ alert looked at reasons, a page for a client's mistake).

The gateway counts with its own tokenizer (`gateway.tokenizer`, the checkpoint's
`tokenizer.json`, the one the workers load) against the context: `gateway.max_model_len`
when set, else the checkpoint's (`config.json`), except with pools that route by prompt
length, whose workers may run a longer context (`model.max_model_len`) than the checkpoint
states: there only an explicit `gateway.max_model_len` is judged by. Without a tokenizer or
a context it judges nothing. Workers that set `model.max_model_len` above the checkpoint's
need `gateway.max_model_len` set alike. The count is a **lower bound** of the worker's, so the gateway never
refuses what a worker would serve:

- `prompt_token_ids`: exact;
- a text `prompt`: its tokens without special tokens (the worker adds BOS and the like);
- chat `messages`: each message's content tokens, less 2 per message for tokens that a
  concatenation may merge across a boundary; the chat template, the roles and `tools` only
  add tokens.

(`worker.client.routing.count_prompt_tokens(..., at_least=True)`, the counter pool routing
uses, in its lower-bound mode.) The workers render the template (the gateway has no template engine), so a
  chat request just over the limit still reaches a worker, which rejects it as before.

A request is refused when that bound plus its `max_tokens` (1 when unset: the worker
fills the rest of the context) exceeds the context, the worker's own `exceeds_context`
rule. The worker's `max_input_tokens`, when set below the context, is not known here.
"""

from __future__ import annotations

from typing import Any

from worker.client.routing import count_prompt_tokens
from worker.gateway.errors import ApiError
from worker.gateway.protocol import GenRequest


def check_context(req: GenRequest, tokenizer: Any, max_model_len: int | None) -> None:
    """Raises ApiError 400 `context_length_exceeded` (param `messages` or `prompt`) when
    `req` cannot fit `max_model_len` tokens whatever the worker counts; nothing without a
    tokenizer or a known context."""
    if tokenizer is None or max_model_len is None:
        return
    n = count_prompt_tokens(req, tokenizer, at_least=True)
    wanted = req.params.max_tokens or 1
    if n + wanted <= max_model_len:
        return
    field = "messages" if req.messages is not None else "prompt"
    asked = f"max_tokens {req.params.max_tokens}" if req.params.max_tokens else "at least 1 token to generate"
    raise ApiError(400, f"the {field} has at least {n} tokens and the request asks for {asked}: more than the "
                        f"model's context of {max_model_len} tokens; shorten the {field} or lower max_tokens",
                   param=field, code="context_length_exceeded")
