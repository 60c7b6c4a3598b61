"""How big a job's input is before it is tokenized: its bytes, and the most bytes a prompt
of N tokens can have, so a prompt whose UTF-8 size alone proves it too long is refused
(or, with pools, sent on) before any tokenizer work (`JobStarter`)."""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.wire import Job

UTF8_MAX_BYTES_PER_CHAR = 4
INLINE_INPUT_BYTES = 2048  # inputs up to this size are processed on the event loop, larger ones in the pool


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the UTF-8 bytes one token can stand for: the longest vocabulary
    entry (byte-level BPE and SentencePiece spell each token with at least as many bytes
    as it decodes to; added tokens are literal text). 4 if the tokenizer has no vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return 4
    return max((len(t.encode("utf-8", "surrogatepass")) for t in get_vocab()), default=4)


def prompt_byte_limit(tokenizer: Any, max_input_tokens: int) -> int:
    """Prompts longer than this many UTF-8 bytes cannot tokenize to `max_input_tokens` or
    fewer: max tokens x bytes per token x 4 (room for normalizers that fold a multi-byte
    character into one byte). Refusing them needs no tokenizer work."""
    return (max_input_tokens + 8) * max_token_bytes(tokenizer) * UTF8_MAX_BYTES_PER_CHAR


def input_bytes(job: Job) -> int:
    """Bytes of the text the chat template or the tokenizer will read: the prompt, or the
    messages (content, tool calls' names and arguments) and the tool definitions."""
    if job.prompt is not None:
        return len(job.prompt.encode("utf-8", "surrogatepass"))
    if job.messages is not None:
        n = len(msgspec.json.encode(job.tools)) if job.tools else 0
        for m in job.messages:
            n += len(m.role) + len((m.content or "").encode("utf-8", "surrogatepass"))
            for c in m.tool_calls or ():
                n += len(c.function.name) + len(c.function.arguments.encode("utf-8", "surrogatepass"))
        return n
    return 0
