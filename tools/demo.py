"""Demo of the engine on a locally made, briefly trained model.

Makes the model on first run (about two minutes on 2 CPU cores), then submits prompts
of all three priorities into one continuous batch, streams one request's tokens live,
cancels another mid-stream and shows its KV blocks freed at the next step.

    python -m tools.demo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEMO_MODEL = Path(".cache/models/demo-llama")
PROMPTS = [
    ("high", "Return the number of"),
    ("normal", "This module provides"),
    ("normal", "The default value is"),
    ("low", "Raise an exception if"),
    ("low", "If the file does not exist,"),
    ("low", "Create a new"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args(argv)

    from tools.make_model import make_checkpoint

    model = Path(a.model)
    if not (model / "config.json").is_file():
        print(f"making a small Llama checkpoint in {model} (trained for 400 steps) ...")
        make_checkpoint(model, arch="llama", train_steps=400)

    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ServingTuning
    from worker.engine import Engine

    engine = Engine.from_pretrained(str(model), EngineConfig(serving_tuning=ServingTuning(
        max_running_requests=4, max_total_tokens=2048, max_batched_tokens=64)))
    ids = []
    for i, (prio, prompt) in enumerate(PROMPTS):
        rid = f"{prio}-{i}"
        engine.add_request(rid, prompt, params=SamplingParams(max_tokens=a.max_tokens, temperature=0.7, top_p=0.9, seed=i),
                           priority=prio)
        ids.append(rid)
    print(f"submitted {len(ids)} requests (max 4 running): {', '.join(ids)}\n")
    streamed, cancel = ids[0], ids[1]
    texts = {rid: "" for rid in ids}
    sys.stdout.write(f"[{streamed}] {PROMPTS[0][1]}")
    step = 0
    streaming = True
    while engine.has_unfinished():
        step += 1
        if step == 8:
            cancel_blocks = len(engine.kv.block_table(cancel))
            engine.abort(cancel)
        for out in engine.step():
            texts[out.request_id] += out.text
            if out.request_id == streamed:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                line = f"step {step:>3}: {out.request_id} finished ({out.finish_reason}, {out.usage.completion_tokens} tokens)"
                if out.request_id == cancel:
                    line += (f"; its {cancel_blocks} KV blocks were freed at this step boundary "
                             f"(block table now {engine.kv.block_table(cancel)})")
                print(f"\n    <{line}>")
                streaming = streaming and out.request_id != streamed
                if streaming:
                    sys.stdout.write(f"[{streamed}] ...")
    print("\nfull texts:")
    for rid, (_, prompt) in zip(ids, PROMPTS):
        print(f"  [{rid}] {prompt}{texts[rid]!r}")
    s = engine.kv_stats()
    print(f"\nKV cache after all requests: used {s.used_blocks}, cached (reusable prefixes) {s.cached_blocks}, "
          f"free {s.free_blocks} of {s.total_blocks} blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
