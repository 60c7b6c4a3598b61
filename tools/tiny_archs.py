"""Tiny random-init checkpoints of many transformers decoder architectures, for the
model-coverage tests and `python -m tools.tiny_archs` (a table: exact / refused / wrong
for every family, the model table of docs/models.md).

`FAMILIES` are the 30 families the model-coverage issue names, each with the config
overrides that make it small *and* keep the feature it is there for (alternating
sliding windows with a 16-token window, soft-capping, sinks, latent attention, Mamba or
linear-attention layers). `shrink_kwargs` makes any other config class small the same
way, for the sweep over every causal-LM architecture transformers ships.

    python -m tools.tiny_archs                # the named families (NAMED_FAMILIES): verdict per family
    python -m tools.tiny_archs --all          # every causal-LM architecture that builds small
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

WINDOW = 16  # small enough that the tests' 40–90-token requests span several windows
SMALL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1,
    n_embd=64, n_layer=2, n_head=4, n_positions=1024, n_inner=128, ffn_dim=128, word_embed_proj_dim=64,
    d_model=64, n_layers=2, n_heads=4, num_layers=2, num_heads=4, d_ff=128, rotary_dim=8,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=4,
    encoder_ffn_dim=128, max_seq_len=1024,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
)
_SMALL_LATENT = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                     num_key_value_heads=4, n_group=1, topk_group=1)
_ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])

MAX_PARAMS = 20_000_000
# family -> (model_type, overrides on top of SMALL)
FAMILIES: dict[str, tuple[str, dict]] = {
    "Llama": ("llama", {}),
    "Qwen2": ("qwen2", {}),
    "Qwen3": ("qwen3", {}),
    "Qwen2-MoE": ("qwen2_moe", {}),
    "Qwen3-MoE": ("qwen3_moe", {}),
    "Mixtral": ("mixtral", {}),
    "Gemma": ("gemma", {}),
    "Phi-3": ("phi3", {}),
    "Phi": ("phi", {}),
    "GPT-NeoX": ("gpt_neox", {}),
    "OLMo2": ("olmo2", {}),
    "StarCoder2": ("starcoder2", {}),
    "Granite": ("granite", {}),
    "Cohere": ("cohere", {}),
    "GPT-2": ("gpt2", {}),
    "GPTBigCode": ("gpt_bigcode", {}),
    "OPT": ("opt", {}),
    "BLOOM": ("bloom", {}),
    "SmolLM3": ("smollm3", {}),
    "GLM-4": ("glm4", {}),
    "Mistral (sliding window)": ("mistral", dict(sliding_window=WINDOW)),
    "Gemma 2": ("gemma2", dict(_ALTERNATING, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                                query_pre_attn_scalar=16)),
    "Gemma 3": ("gemma3_text", dict(_ALTERNATING, query_pre_attn_scalar=16)),
    "GPT-OSS": ("gpt_oss", dict(_ALTERNATING)),
    "EXAONE 4": ("exaone4", dict(_ALTERNATING)),
    "OLMo 3": ("olmo3", dict(_ALTERNATING)),
    "DeepSeek-V3": ("deepseek_v3", dict(first_k_dense_replace=1)),
    "Falcon": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "Qwen3-Next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)),
    "Jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2, use_mamba_kernels=False)),
}
# Families whose every mixer keeps per-request recurrent state, or hybrids of such mixers
# with attention (`worker/model/recurrent.py`; Zamba's one attention block shared by its
# hybrid layers, `legacy.py`), beside Qwen3-Next and Jamba above; each with the fields that
# make its tiny config build and keep an attention layer where the family has them.
STATE_FAMILIES: dict[str, tuple[str, dict]] = {
    "Mamba": ("mamba", {}),
    "Mamba-2": ("mamba2", dict(num_heads=8, head_dim=16, n_groups=1)),
    "FalconMamba": ("falcon_mamba", {}),
    "Bamba": ("bamba", dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                            mamba_chunk_size=16)),
    "Falcon-H1": ("falcon_h1", dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                    mamba_chunk_size=16)),
    "Nemotron-H": ("nemotron_h", dict(num_hidden_layers=4, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                                      n_groups=1)),
    "Granite-4 hybrid": ("granitemoehybrid", dict(layer_types=["linear_attention", "attention"], mamba_n_heads=8,
                                                  mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)),
    "LFM2": ("lfm2", dict(layer_types=["conv", "full_attention"])),
    "Zamba": ("zamba", dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                            attn_layer_period=2, attn_layer_offset=1)),
    "Zamba2": ("zamba2", dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                              hybrid_layer_ids=[1, 2])),
    "Kimi-Linear": ("kimi_linear", dict(num_experts_per_token=2, layer_types=["linear_attention", "full_attention"],
                                        mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=4)),
    "MiniMax": ("minimax", {}),
    "LaRA-mini": ("lara_mini", dict(sliding_window=WINDOW)),  # gated delta net beside windowed attention
}
# An architecture the engine refuses at load (a sparse top-k attention indexer), for the
# tests of the refusal path: none of the families above is refused any more.
REFUSED_FAMILIES: dict[str, tuple[str, dict]] = {"DeepSeek-V3.2": ("deepseek_v32", {})}
REFUSED = {"DeepSeek-V3.2": "indexed_attention layers"}  # family -> what its refusal names
NAMED_FAMILIES = FAMILIES | STATE_FAMILIES | REFUSED_FAMILIES


def shrink_kwargs(config_cls, overrides: dict | None = None) -> dict:
    """SMALL's fields that `config_cls` knows, plus `overrides` (None values drop a field)."""
    base = config_cls()
    known = set(base.to_dict()) | set(vars(base))
    kwargs = {k: v for k, v in SMALL.items() if k in known}
    if "kv_lora_rank" in known:  # latent attention: small latent dims, one KV head per query head
        kwargs.update({k: v for k, v in _SMALL_LATENT.items() if k in known})
        kwargs.pop("head_dim", None)
    kwargs.update(overrides or {})
    return {k: v for k, v in kwargs.items() if v is not None}


def make_tiny(model_type: str, out: Path, tokenizer_dir: Path, overrides: dict | None = None, seed: int = 0) -> Path:
    """Write a random-init checkpoint of `model_type` (weights ~ N(0, 0.1), so greedy
    tokens vary) with the tokenizer files of `tokenizer_dir`. Returns `out`."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig

    cls = CONFIG_MAPPING[model_type]
    config = cls(**shrink_kwargs(cls, overrides))
    with torch.device("meta"):  # a config that does not shrink (nested sub-configs) is not built at full size
        num_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if num_params > MAX_PARAMS:
        raise ValueError(f"{model_type} does not shrink with these fields: {num_params / 1e6:.0f}M parameters")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=False)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def staggered_requests(seed: int = 0, lens=((40, 0), (23, 3), (57, 7), (90, 12)), vocab: int = 500):
    """(id, prompt ids, add at step): requests that join a running batch at different steps."""
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(1, vocab) for _ in range(n)], at) for i, (n, at) in enumerate(lens)]


def run_engine(path: Path, requests, max_tokens: int, *, backend: str = "torch", block_size: int = 16,
               max_batched_tokens: int = 16, max_total_tokens: int = 4096, kv_policy: str = "optimistic",
               on_step=None, on_forward=None, async_scheduling: bool = False, compile_mode: str = "off",
               forward: list[str] | None = None, device: str = "cpu") -> dict:
    """Greedy, EOS ignored, chunked prefill (`max_batched_tokens`). Returns
    request id -> (token ids, finish reason). `on_step(engine)` runs after every step,
    `on_forward(scheduler_output)` at the start of every forward (on the forward thread
    with `async_scheduling`); `compile_mode` is `model.compile`, and `forward` gets how
    the forward ran (`CompileReport.describe`)."""
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    cfg = EngineConfig(model=ModelConfig(dtype="float32", device=device, attention_backend=backend,
                                         compile=compile_mode),
                       serving_tuning=ServingTuning(max_total_tokens=max_total_tokens, kv_block_size=block_size,
                                                    max_batched_tokens=max_batched_tokens, max_running_requests=8,
                                                    max_output_tokens=max_tokens,
                                                    kv_policy=kv_policy, async_scheduling=async_scheduling))
    engine = Engine.from_pretrained(str(path), cfg)
    if forward is not None:
        forward.append(engine.compile_report.describe())
    if on_forward is not None:
        build = engine.runner.build_metadata  # every forward packs its step here, launched or not

        def spy(sched):
            on_forward(sched)
            return build(sched)

        engine.runner.build_metadata = spy
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    finals: dict[str, str] = {}
    step = 0
    while len(finals) < len(requests):
        for rid, prompt, at in requests:
            if at == step:
                engine.add_request(rid, prompt_token_ids=prompt,
                                   params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
        if on_step is not None:
            on_step(engine)
        step += 1
        if step > 5000:
            raise RuntimeError("engine did not finish the requests in 5000 steps")
    return {rid: (tokens[rid], finals[rid]) for rid in tokens}


def reference(path: Path, requests, max_tokens: int, device: str = "cpu") -> dict[str, list[int]]:
    """transformers' `generate` for each request alone (greedy, exactly max_tokens: no
    EOS id, so no logits processor touches the scores, as the engine's `ignore_eos`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    out = {}
    for rid, prompt, _ in requests:
        ids = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens, do_sample=False)
        out[rid] = ids[0, len(prompt):].tolist()
    return out


def verdict(path: Path, max_tokens: int = 24, with_forward: bool = False, device: str = "cpu",
            **engine_kwargs) -> dict:
    """exact | refused (with the loader's line) | wrong (first differing position per
    request) | not built (transformers' own `generate` fails on this tiny config: nothing
    to compare with). `with_forward`: exact and wrong verdicts also say how the forward
    ran (`forward`: compiled, eager and why, graphs)."""
    from worker.model.capability import UnsupportedModel

    requests = staggered_requests()
    forward: list[str] = []
    try:  # first: nothing to compare with is found before the engine runs the requests
        ref = reference(path, requests, max_tokens, device=device)
    except Exception as e:
        ref = None
        not_built = {"result": "not built", "why": f"transformers' generate: {type(e).__name__}: {str(e)[:160]}"}
    try:
        got = run_engine(path, requests if ref is not None else [], max_tokens, forward=forward, device=device,
                         **engine_kwargs)
    except UnsupportedModel as e:
        return {"result": "refused", "why": str(e)}
    if ref is None:  # loaded (not refused), nothing to judge it by
        return not_built
    bad = {}
    for rid, (ids, reason) in got.items():
        if ids != ref[rid] or reason != "length":
            first = next((i for i, (a, b) in enumerate(zip(ids, ref[rid])) if a != b), min(len(ids), len(ref[rid])))
            bad[rid] = {"first_diff": first, "finish_reason": reason}
    out = {"result": "wrong", "requests": bad} if bad else {"result": "exact"}
    return {**out, "forward": forward[0]} if with_forward else out


def _judge(model_type: str, out: Path, tokenizer_dir: Path, overrides: dict, **engine_kwargs) -> dict:
    try:
        path = make_tiny(model_type, out, tokenizer_dir, overrides)
    except Exception as e:  # a config class that cannot be built small: reported, not judged
        return {"result": "not built", "why": f"{type(e).__name__}: {str(e)[:160]}"}
    try:
        return verdict(path, **engine_kwargs)
    except Exception as e:
        return {"result": "failed", "why": f"{type(e).__name__}: {str(e)[:200]}"}


def _judge_isolated(model_type: str, out: Path, tokenizer_dir: Path, overrides: dict, timeout_s: float,
                    **engine_kwargs) -> dict:
    """`_judge` in a forked child (a crash or a hang of one architecture is its verdict)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def work() -> None:
        child.send(_judge(model_type, out, tokenizer_dir, overrides, **engine_kwargs))

    proc = ctx.Process(target=work, daemon=True)
    proc.start()
    child.close()
    ready = parent.poll(timeout_s)
    try:
        result = parent.recv() if ready else None
    except EOFError:  # the child died without an answer
        result = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
    if result is None:
        return {"result": "failed", "why": "timed out" if not ready else f"the process died (exit {proc.exitcode})"}
    return result


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true",
                   help="every causal-LM architecture of transformers, not the named families")
    p.add_argument("--out", default=".cache/tiny-archs", help="where checkpoints are written")
    p.add_argument("--json", help="write the verdicts here")
    p.add_argument("--timeout-s", type=float, default=300, help="per architecture")
    p.add_argument("--compile", action="store_true",
                   help="model.compile: on (each exact architecture compiled, or fallen back with its reason)")
    p.add_argument("--graphs", action="store_true",
                   help="decode steps replayed from graphs, emulated on the CPU (worker.model.graphs)")
    a = p.parse_args(argv)
    if a.graphs:
        from worker.engine import compile as compile_rules

        compile_rules.emulate_graphs_on_cpu()
    engine_kwargs = {"with_forward": a.compile or a.graphs, **({"compile_mode": "on"} if a.compile else {})}
    from transformers.utils import logging as hf_logging

    from tests.conftest import tiny_checkpoint

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tok = tiny_checkpoint("llama")
    todo = ({mt: (mt, {}) for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} if a.all
            else NAMED_FAMILIES)
    results = {}
    for name, (model_type, overrides) in todo.items():
        t0 = time.time()
        results[name] = _judge_isolated(model_type, Path(a.out) / model_type, tok, overrides, a.timeout_s,
                                        **engine_kwargs)
        results[name]["s"] = round(time.time() - t0, 1)
        detail = results[name].get("why") or (results[name].get("forward", "") if a.compile or a.graphs else "")
        print(f"{name:28s} {results[name]['result']:9s} {detail[:110]}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    print(counts)
    if a.compile or a.graphs:  # of the exact ones: how many ran compiled / on graphs, and why the others did not
        exact = [r["forward"] for r in results.values() if r["result"] == "exact"]
        print({"exact": len(exact), "compiled": sum(f.startswith("compiled") for f in exact),
               "on graphs": sum("graphs emulated for" in f or "CUDA graphs for" in f for f in exact)})
    return 0 if not counts.get("wrong") and not counts.get("failed") else 1


if __name__ == "__main__":
    sys.exit(main())
