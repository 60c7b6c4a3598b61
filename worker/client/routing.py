"""Routing at the edge for pools by prompt length (schemas/pools.py): a producer that can
count a job's prompt tokens writes it to the pool that serves that length; one that
cannot writes to the default pool, whose workers forward what is not theirs
(worker/serve/pool_router.py). Used by `InflightClient` and the gateway.

Counting follows the worker's tokenizer: token ids are counted as given; a text prompt is
encoded with special tokens (the worker's BOS rule may drop a duplicate: at most one token
less); chat messages go through the tokenizer's chat template when it has one (a
transformers tokenizer), else the contents are counted alone, a lower bound — a count
that lands a job in the wrong pool costs one forward, never a wrong answer.
"""

from __future__ import annotations

from typing import Any

from schemas.pools import DEFAULT_POOL, Pools
from schemas.wire import Job


def load_tokenizer(path: str) -> Any:
    """A `tokenizers.Tokenizer` from a `tokenizer.json` file or a checkpoint directory
    holding one.

    Raises:
        ImportError: the `tokenizers` package is missing.
        FileNotFoundError, Exception: the file cannot be read.
    """
    from pathlib import Path

    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


MERGE_SLACK_PER_MESSAGE = 2  # tokens one message boundary may lose to a merge, generously


def _encode(tokenizer: Any, text: str, special: bool = True) -> int:
    ids = tokenizer.encode(text, add_special_tokens=special)
    return len(getattr(ids, "ids", ids))


def count_prompt_tokens(job: Job, tokenizer: Any = None, *, at_least: bool = False) -> int | None:
    """The job's prompt tokens as the worker will count them (module docstring); None
    when it cannot be counted here (no tokenizer for a text or chat prompt). `job`: a
    `Job`, or anything with its prompt fields (the gateway's `GenRequest`).

    `at_least`: a count never above the worker's (the gateway's context check refuses
    on it): a text prompt without special tokens, chat contents without a template less
    `MERGE_SLACK_PER_MESSAGE` per message (a concatenation may merge across a boundary)."""
    if job.prompt_token_ids is not None:
        return len(job.prompt_token_ids)
    if tokenizer is None:
        return None
    if job.prompt is not None:
        return _encode(tokenizer, job.prompt, special=not at_least)
    messages = [m.template_dict() for m in job.messages or ()]
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None:
        try:
            return len(template(messages, tools=job.tools or None, add_generation_prompt=True, tokenize=True,
                                return_dict=False))
        except Exception:  # a template the worker will refuse too: it answers for the job
            pass
    contents = [m.get("content") or "" for m in messages]
    if not at_least:
        return sum(_encode(tokenizer, c) for c in contents)
    contents = [c for c in contents if c]
    counted = sum(_encode(tokenizer, c, special=False) for c in contents)
    return max(0, counted - MERGE_SLACK_PER_MESSAGE * len(contents))


def pool_for(pools: Pools, job: Job, tokenizer: Any = None) -> str:
    """The pool whose topics `job` is written to: the one serving its prompt length when
    that can be counted here, else the default pool (whose workers forward). A job longer
    than every pool goes to the default pool too, whose workers reject it."""
    if not pools.routes:
        return DEFAULT_POOL
    n = count_prompt_tokens(job, tokenizer)
    pool = pools.route(n) if n is not None else None
    return pool.name if pool is not None else DEFAULT_POOL
