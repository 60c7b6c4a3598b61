"""Inflight: a queue-fed LLM serving worker. The folders are the architecture:

    engine/    requests, scheduler, KV cache, the engine core's step loop, its process and
               the client the worker drives it through (torch only below `model/`)
    model/     loading a checkpoint, the paged model runner, attention kernels, sampling
    config/    every setting, validated, with errors naming the field
    serve/     the worker: Kafka jobs in, the job table, Redis streams out, Kafka out
    security/  Kafka and Redis security settings, the ACL recipe, refusals
    client/    InflightClient (submit, stream, cancel) for producers; no torch
    cli/       what the `inflight` commands do (argparse is in `__main__.py`)
    obs/       metrics, logging
    gateway/   the OpenAI-compatible HTTP front door (and `batch/`, the Batch API)

Which room may import which: docs/architecture.md#layer-rules, the table of
tests/repo/test_import_graph.py, which holds them.
"""
