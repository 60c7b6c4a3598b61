"""Structured-output benchmark, all numbers from one run on one machine:

  libraries  llguidance vs xgrammar on the benchmark model's tokenizer, same schema:
             compile time (first and cached) and mask time per step at --batch
             constrained rows, both stepped in lockstep by random tokens both allow
             (tokens only one of them allows are counted and the first one shown).
  engine     Inflight's engine on the benchmark model with --batch running requests,
             every one constrained by a 10-field JSON Schema vs none constrained (same
             prompts, same steps): mean step time at full batch, the overhead ratio, and
             the mask time per step (what a GPU step would have to hide).
  validity   --jobs constrained jobs (greedy and sampled, the 10-field schema and the
             test schemas) through the engine: every stop must parse and validate
             (jsonschema); invalid outputs are counted (the goal is 0).

Writes bench_structured.json and bench_structured.png under --out, prints a table.

    python -m tools.bench.structured                  # ~2 min on the 2-core CPU box
    python -m tools.bench.structured --jobs 1000 --batch 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tools.bench.harness import DEFAULT_MODEL, ensure_model, report_header

# 10 fields: strings (bounded), bounded integers, enums, an array, a nested object, a boolean
TEN_FIELDS = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "note": {"type": ["string", "null"], "maxLength": 20},
    },
    "required": ["id", "name", "email", "age", "active", "role", "score", "tags", "address", "note"],
    "additionalProperties": False,
}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False}


# ---- libraries ----------------------------------------------------------------------------
def bench_libraries(model: Path, batch: int, steps: int) -> dict:
    """Both libraries step the same rows in lockstep: each step both fill their masks
    (timed apart) and every row takes a random token both allow, so neither is timed on
    states the other never reaches. Tokens one allows and the other refuses are counted."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln
    from transformers import AutoConfig, AutoTokenizer

    from schemas.structured import COMPACT_JSON

    tok = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(TEN_FIELDS, defaults=COMPACT_JSON)
    t0 = time.perf_counter()
    template = llguidance.LLMatcher(llt, grammar, log_level=0)
    ll_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    ll = [template.deep_copy() for _ in range(batch)]
    ll_copy = (time.perf_counter() - t0) / batch
    ll_bits = lln.allocate_token_bitmask(batch, vocab)
    out: dict = {"llguidance": {"compile_ms": ll_compile * 1e3, "copy_ms": ll_copy * 1e3}}
    try:
        import xgrammar as xgr
    except ImportError as e:  # optional: the dev extra installs it
        xgr = None
        out["xgrammar"] = {"skipped": f"xgrammar not installed ({e})"}
    if xgr is not None:
        schema_text = json.dumps(TEN_FIELDS)
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(schema_text, any_whitespace=False, separators=(",", ":"))
        xg_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile_json_schema(schema_text, any_whitespace=False, separators=(",", ":"))
        out["xgrammar"] = {"compile_ms": xg_compile * 1e3, "cached_compile_ms": (time.perf_counter() - t0) * 1e3}
        xg = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        xg_bits = xgr.allocate_token_bitmask(batch, vocab).numpy()
    rng = random.Random(0)
    ll_mask, xg_mask, disagree = [], [], {"only_llguidance": 0, "only_xgrammar": 0}
    example = None
    text: list[list[int]] = [[] for _ in range(batch)]
    for _ in range(steps):
        live = [i for i in range(batch) if not ll[i].is_stopped() and (xgr is None or not xg[i].is_terminated())]
        if not live:
            break
        t0 = time.perf_counter()
        for i in live:  # one thread, as the engine fills on a CPU box (worker.model.masks._parallel_fill)
            lln.fill_next_token_bitmask(ll[i], ll_bits, i)
        ll_mask.append(time.perf_counter() - t0)
        allowed = np.unpackbits(ll_bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
        if xgr is not None:
            t0 = time.perf_counter()
            for i in live:
                xg[i].fill_next_token_bitmask(torch_view(xg_bits), i)
            xg_mask.append(time.perf_counter() - t0)
            xa = np.unpackbits(xg_bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
            for i in live:
                disagree["only_llguidance"] += int((allowed[i] & ~xa[i]).sum())
                disagree["only_xgrammar"] += int((xa[i] & ~allowed[i]).sum())
                if example is None and (allowed[i] != xa[i]).any():
                    t = int(np.flatnonzero(allowed[i] != xa[i])[0])
                    example = f"after {tok.decode(text[i])!r}: {tok.decode([t])!r} allowed by " + (
                        "llguidance only" if allowed[i, t] else "xgrammar only")
            allowed = allowed & xa
        for i in live:
            ids = np.flatnonzero(allowed[i])
            if not len(ids):
                continue
            # now and then the highest id (often a closing token) so strings do not run forever
            t = int(ids[rng.randrange(len(ids))]) if rng.random() < 0.7 else int(ids[-1])
            assert ll[i].consume_token(t), ll[i].get_error()
            if xgr is not None:
                assert xg[i].accept_token(t)
            text[i].append(t)
    out["llguidance"].update(mask_ms_per_step=statistics.mean(ll_mask) * 1e3, steps=len(ll_mask))
    if xgr is not None:
        out["xgrammar"].update(mask_ms_per_step=statistics.mean(xg_mask) * 1e3, steps=len(xg_mask),
                               disagreeing_tokens=disagree, first_disagreement=example)
    return out


def torch_view(a: np.ndarray):
    import torch

    return torch.from_numpy(a)


# ---- engine --------------------------------------------------------------------------------
def _engine(model: Path, batch: int, **tuning):
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    cfg = EngineConfig(model=ModelConfig(device="cpu"), serving_tuning=ServingTuning(
        max_running_requests=batch, max_total_tokens=batch * 512, max_batched_tokens=1024, max_input_tokens=512,
        max_output_tokens=512, enable_prefix_caching=False, **tuning))
    return Engine.from_pretrained(str(model), cfg)


def bench_engine(model: Path, batch: int, tokens: int, rounds: int = 3, **tuning) -> dict:
    """Full-batch step time, every request constrained vs none (same prompts), in
    alternating rounds (the shared box's load drifts): the median of the per-round ratios."""
    from schemas.params import JsonSchemaOutput, SamplingParams

    engine = _engine(model, batch, **tuning)
    prompts = [[(31 * i + j) % 1900 + 20 for j in range(24)] for i in range(batch)]
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for r in range(rounds):
        for name, structured in (("unconstrained", None), ("constrained", JsonSchemaOutput(schema=TEN_FIELDS))):
            params = SamplingParams(temperature=1.0, seed=1, max_tokens=tokens, ignore_eos=structured is None,
                                    structured=structured)
            for i, p in enumerate(prompts):
                engine.add_request(f"{name}-{r}-{i}", prompt_token_ids=p, params=params)
            steps, masks = [], []
            while engine.has_unfinished():
                engine.step()
                st = engine.last_step_stats
                if st.num_running >= batch * 0.9 and st.num_prefill_tokens == 0:
                    steps.append(st.duration_s)
                    masks.append(st.mask_s)
            runs[name].append({"steps": len(steps), "step_ms": statistics.mean(steps) * 1e3,
                               "mask_ms_per_step": statistics.mean(masks) * 1e3})
    result = {name: {"step_ms": statistics.median(x["step_ms"] for x in rs),
                     "mask_ms_per_step": statistics.median(x["mask_ms_per_step"] for x in rs), "rounds": rs}
              for name, rs in runs.items()}
    ratios = [c["step_ms"] / u["step_ms"] for c, u in zip(runs["constrained"], runs["unconstrained"])]
    result["overhead"] = statistics.median(ratios) - 1.0
    result["overhead_per_round"] = [x - 1.0 for x in ratios]
    return result


def bench_validity(model: Path, batch: int, jobs: int) -> dict:
    """`jobs` constrained jobs (half greedy, half sampled; the 10-field schema and a small
    one): every stop parses and validates; `length` finishes are counted apart."""
    import jsonschema

    from schemas.params import JsonSchemaOutput, SamplingParams

    engine = _engine(model, batch)
    schemas = [TEN_FIELDS, SMALL]
    params = [SamplingParams(max_tokens=256, temperature=0.0 if i % 2 else 1.0, seed=i,
                             structured=JsonSchemaOutput(schema=schemas[i % 4 // 2])) for i in range(jobs)]
    prompts = [[(17 * i + j) % 1900 + 20 for j in range(8 + i % 16)] for i in range(jobs)]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    invalid, length = 0, 0
    for o, p in zip(outs, params):
        if o.finish_reason == "length":
            length += 1
            continue
        try:
            jsonschema.validate(json.loads(o.text), p.structured.schema)
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    return {"jobs": jobs, "invalid": invalid, "length": length, "seconds": seconds,
            "jobs_per_s": jobs / seconds}


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    libs = {k: v for k, v in report["libraries"].items() if "mask_ms_per_step" in v}
    a1.bar(list(libs), [v["mask_ms_per_step"] for v in libs.values()], color=["#2a7", "#c63"][: len(libs)])
    a1.set_ylabel(f"mask ms per step at batch {report['batch']}")
    a1.set_title("10-field JSON Schema, same tokens")
    e = report["engine"]
    a2.bar(["unconstrained", "constrained"], [e["unconstrained"]["step_ms"], e["constrained"]["step_ms"]],
           color=["#888", "#2a7"])
    a2.set_ylabel("engine step ms (full batch)")
    a2.set_title(f"overhead {e['overhead'] * 100:+.1f}%")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint (made if it is the default)")
    p.add_argument("--batch", type=int, default=64, help="running requests / constrained rows")
    p.add_argument("--steps", type=int, default=200, help="mask steps measured per library")
    p.add_argument("--tokens", type=int, default=96, help="max tokens per request in the engine comparison")
    p.add_argument("--jobs", type=int, default=1000, help="constrained jobs checked for validity")
    p.add_argument("--rounds", type=int, default=5, help="alternating constrained / unconstrained engine rounds")
    p.add_argument("--out", default="results", help="folder for JSON and PNG results")
    a = p.parse_args(argv)
    a.command_line = " ".join(["python -m tools.bench.structured", *(argv if argv is not None else sys.argv[1:])])
    model = ensure_model(a.model)
    report = report_header("structured", a, model, "cpu")
    report["batch"] = a.batch
    report["libraries"] = bench_libraries(model, a.batch, a.steps)
    report["engine"] = bench_engine(model, a.batch, a.tokens, a.rounds)
    report["validity"] = bench_validity(model, a.batch, a.jobs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_structured.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "bench_structured.png")
    for lib, r in report["libraries"].items():
        if "skipped" in r:
            print(f"{lib:11s} {r['skipped']}")
            continue
        print(f"{lib:11s} compile {r['compile_ms']:7.2f} ms   mask {r['mask_ms_per_step']:.3f} ms/step "
              f"at batch {a.batch}")
        if r.get("first_disagreement"):
            print(f"{'':11s} tokens allowed by one library only: {r['disagreeing_tokens']} "
                  f"(first: {r['first_disagreement']})")
    e = report["engine"]
    print(f"engine      step {e['unconstrained']['step_ms']:.2f} ms unconstrained, {e['constrained']['step_ms']:.2f} "
          f"ms all constrained: overhead {e['overhead'] * 100:+.1f}% (median of rounds "
          f"{', '.join(f'{x * 100:+.0f}%' for x in e['overhead_per_round'])}), mask "
          f"{e['constrained']['mask_ms_per_step']:.3f} ms/step")
    v = report["validity"]
    print(f"validity    {v['invalid']} invalid of {v['jobs'] - v['length']} complete outputs "
          f"({v['length']} cut by max_tokens), {v['jobs_per_s']:.1f} jobs/s")
    return 0 if v["invalid"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
