"""`inflight` command line.

    inflight generate --model PATH --prompt "Hello" [--max-tokens 64] [--temperature 0] [--priority high]
"""

from __future__ import annotations

import argparse
import sys


def _generate(a: argparse.Namespace) -> int:
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig
    from worker.engine import Engine, RequestRejected

    engine = Engine.from_pretrained(a.model, EngineConfig(model=ModelConfig(device=a.device)))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                            stop=a.stop or [])
    try:
        for i, prompt in enumerate(a.prompt):
            engine.add_request(f"cli-{i}", prompt, params=params, priority=a.priority)
    except RequestRejected as e:
        print(f"rejected: {e}", file=sys.stderr)
        return 2
    single = len(a.prompt) == 1
    while engine.has_unfinished():
        for out in engine.step():
            if single:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                tail = f"[{out.request_id}: {out.finish_reason}, {out.usage.completion_tokens} tokens]"
                print(("\n" if single else "") + tail, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="inflight", description="Inflight LLM serving worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="run prompts through the engine in this process and stream the text")
    g.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    g.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    if a.cmd == "generate":
        return _generate(a)
    return 1


if __name__ == "__main__":
    sys.exit(main())
