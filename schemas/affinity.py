"""Prefix affinity: the job-topic partition a producer picks so that jobs sharing a prompt
prefix meet on one worker, whose prefix cache then computes the prefix once for all of
them (`kafka.affinity_prefix_bytes`). The routers of llm-d (its KV-aware endpoint
picker), Dynamo (its KV router) and SGLang (its cache-aware router) place requests by
prefix in front of the engines; here the job topic's partition does it, since a consumer
group keeps each partition on one worker.

This module is the wire-level recipe, so producers in any language can follow it (the
exact bytes are in docs/concepts.md); `worker.client.affinity` adds the producer's state
(which prefixes are hot).

1. **The head** of a job (`prompt_head`): the bytes that come first in what the model
   reads, without its tokenizer or chat template:
   - `prompt`: its UTF-8 bytes;
   - `messages`: for each tool of `tools`, `tool` NUL `<function name>` NUL; then for each
     message, `<role>` NUL `<content>` NUL (a null content: nothing between the NULs),
     followed by `<name>` NUL `<arguments>` NUL for each of its `tool_calls`;
   - `prompt_token_ids`: each id as 4 bytes, unsigned little-endian.
2. **The prefix hash** (`prefix_hash`): BLAKE2b with an 8-byte digest of the head's first
   `prefix_bytes` bytes, read as an unsigned big-endian integer; no hash when the head is
   shorter (the job keeps the default partitioner: its key, the job id).
3. **The partition** (`affinity_partition`): `(prefix_hash + job_hash % k) % P` for a
   topic of `P` partitions, where `job_hash` is the same BLAKE2b of the job id's UTF-8
   bytes and `k` (1 ≤ k ≤ P) is how many partitions the prefix is spread over: 1 for a
   prefix carrying at most its share of one partition, more for a hot one (the producer's
   rule: `worker.client.affinity.PrefixAffinity`). A prefix's partitions are consecutive
   from its own, so a growing `k` keeps the partitions it had.

The record's key stays the job id: the worker recovers a malformed record's id from it,
and the DLQ keeps it.
"""

from __future__ import annotations

import hashlib
import struct

from schemas.wire import Job


def prompt_head(job: Job) -> bytes:
    """The job's head (rule 1 of the module docstring)."""
    if job.prompt is not None:
        return job.prompt.encode("utf-8")
    if job.prompt_token_ids is not None:
        return struct.pack(f"<{len(job.prompt_token_ids)}I", *job.prompt_token_ids)
    parts: list[bytes] = []
    for tool in job.tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        parts += [b"tool\0", str(name or "").encode("utf-8"), b"\0"]
    for m in job.messages or ():
        parts += [m.role.encode("utf-8"), b"\0", (m.content or "").encode("utf-8"), b"\0"]
        for call in m.tool_calls or ():
            parts += [call.function.name.encode("utf-8"), b"\0", call.function.arguments.encode("utf-8"), b"\0"]
    return b"".join(parts)


def blake8(data: bytes) -> int:
    """BLAKE2b, 8-byte digest, as an unsigned big-endian integer."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_hash(job: Job, prefix_bytes: int) -> int | None:
    """The hash of the head's first `prefix_bytes` bytes; None when the head is shorter
    (or `prefix_bytes` is 0: affinity off)."""
    if prefix_bytes <= 0:
        return None
    head = prompt_head(job)
    if len(head) < prefix_bytes:
        return None
    return blake8(head[:prefix_bytes])


def affinity_partition(prefix: int, job_id: str, spread: int, num_partitions: int) -> int:
    """Rule 3: the partition of a job whose prefix hashes to `prefix`, spread over `spread`
    consecutive partitions of `num_partitions`."""
    k = max(1, min(spread, num_partitions))
    return (prefix + blake8(job_id.encode("utf-8")) % k) % num_partitions
