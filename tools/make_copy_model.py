"""Make a Llama checkpoint that copies its prompt: a CPU benchmark model for copy-heavy
workloads (edit this, quote that), which no trained CPU checkpoint of ours produces.

Its weights are written, not trained: a two-layer induction circuit (the mechanism found
in trained transformers by Elhage et al., "A Mathematical Framework for Transformer
Circuits", 2021, and Olsson et al., "In-context Learning and Induction Heads", 2022),
built by hand in a standard `LlamaForCausalLM` that transformers, vLLM and the engine
load as any other. Given the last three tokens, it predicts the token that followed the
same three tokens earlier in the context; where several earlier places match, it follows
one of them (the one the arithmetic ranks first), so its answers are spans of its prompt
joined where the prompt repeats itself, as an answer that quotes or edits its input is.

The residual stream (`hidden` 384) holds, per position, in blocks of `CODE` (64) dims: the
token's code (a random +-1/8 vector per vocabulary entry, from `--seed`), the codes of the
1, 2 and 3 tokens before it, the predicted token's code, and one constant dim.

- Layer 0, heads 0-2: each attends to the token 1, 2 or 3 positions back and copies its
  code into its block. Queries and keys are constant vectors (from the constant dim) in
  the 16 fastest rotary pairs, the key turned by delta x theta_f, so that RoPE makes the
  score `sum_f w_f cos(theta_f (d - delta))`, highest at distance d = delta (w_f = 0.8^f;
  29 logits per unit of w: the nearest other distance scores about 25 logits less).
- Layer 1, head 0: the query is the codes of tokens i, i-1, i-2, the key at j those of
  j-1, j-2, j-3, each offset in its own random signed permutation (so only aligned
  offsets match), in the 32 rotary pairs that turn by <= 1e-4 radians a position
  (`rope_theta` 1e8, `head_dim` 128): a matching trigram scores 12 logits per aligned
  token above a place matching one fewer. The value is the code of token j, written into
  the prediction block.
- Layers 2-3 and every MLP are zero (the residual passes through); RMSNorm weights are 1;
  `lm_head` reads only the prediction block (row t: 8 x code(t)).

The tokenizer is the benchmark checkpoints' (byte-level BPE, vocabulary 2048, trained on
the standard library's docstrings as `tools/make_model.py` trains it).

    python -m tools.make_copy_model .cache/models/bench-llama-copy
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS, INTERMEDIATE = 2048, 384, 3, 128, 4, 768
ROPE_THETA = 1e8
CODE = 64
TOKEN, PREV = 0, (64, 128, 192)  # residual blocks: the token's code, the codes 1, 2, 3 back
PREDICTION, CONSTANT = 256, 320
FAST_PAIRS = 16  # rotary pairs 0..15 (1 to 0.013 rad a position): the positional heads
SLOW_PAIRS = range(32, 64)  # 1e-4 rad a position and less: the content match
POSITION_LOGITS, MATCH_LOGITS = 29.0, 12.0


def build(seed: int = 0):
    """The model (a `LlamaForCausalLM` in float32, weights as the module docstring says)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_parameters={"rope_theta": ROPE_THETA, "rope_type": "default"},
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config).float()
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randint(0, 2, (VOCAB, CODE), generator=g).float() * 2 - 1) / math.sqrt(CODE)  # unit norm
    theta = ROPE_THETA ** (-torch.arange(HEAD_DIM // 2, dtype=torch.float64) * 2 / HEAD_DIM)
    softmax_scale = HEAD_DIM ** -0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        emb = model.model.embed_tokens.weight
        emb[:, TOKEN:TOKEN + CODE] = codes
        emb[:, CONSTANT] = 1.0

        # layer 0: its input is code + constant (|x|^2 = 2), which RMSNorm scales by sqrt(HIDDEN / 2)
        attn, gain = model.model.layers[0].self_attn, math.sqrt(HIDDEN / 2)
        w = 0.8 ** torch.arange(FAST_PAIRS, dtype=torch.float64)
        amp = math.sqrt(POSITION_LOGITS / softmax_scale)
        for h, (delta, block) in enumerate(zip((1, 2, 3), PREV)):
            for f in range(FAST_PAIRS):
                angle = float(theta[f]) * delta
                attn.q_proj.weight[h * HEAD_DIM + f, CONSTANT] = amp / gain
                attn.k_proj.weight[h * HEAD_DIM + f, CONSTANT] = amp * float(w[f]) * math.cos(angle) / gain
                attn.k_proj.weight[h * HEAD_DIM + f + HEAD_DIM // 2, CONSTANT] = (amp * float(w[f]) * math.sin(angle)
                                                                                   / gain)
            for i in range(CODE):
                attn.v_proj.weight[h * HEAD_DIM + i, TOKEN + i] = 1.0 / gain
                attn.o_proj.weight[block + i, h * HEAD_DIM + i] = 1.0

        # layer 1: its input is code + three codes back + constant (|x|^2 = 5)
        attn, gain = model.model.layers[1].self_attn, math.sqrt(HIDDEN / 5)
        slow = [f for f in SLOW_PAIRS] + [f + HEAD_DIM // 2 for f in SLOW_PAIRS]
        amp = math.sqrt(MATCH_LOGITS / softmax_scale)
        for q_block, k_block in ((TOKEN, PREV[0]), (PREV[0], PREV[1]), (PREV[1], PREV[2])):
            perm = torch.randperm(CODE, generator=g)
            sign = torch.randint(0, 2, (CODE,), generator=g).float() * 2 - 1
            for i in range(CODE):
                d = slow[int(perm[i])]
                attn.q_proj.weight[d, q_block + i] = float(sign[i]) * amp / gain
                attn.k_proj.weight[d, k_block + i] = float(sign[i]) * amp / gain
        for i in range(CODE):
            attn.v_proj.weight[i, TOKEN + i] = 1.0 / gain
            attn.o_proj.weight[PREDICTION + i, i] = 1.0
        model.lm_head.weight[:, PREDICTION:PREDICTION + CODE] = codes * math.sqrt(CODE)
    return model


def make_copy_model(out: str | Path, seed: int = 0, corpus_chars: int = 600_000) -> Path:
    """Write the checkpoint and the benchmark tokenizer to `out` (seconds)."""
    from tools.make_model import stdlib_docstrings, train_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(stdlib_docstrings(corpus_chars), VOCAB)
    if len(tokenizer) > VOCAB:
        raise ValueError(f"the tokenizer has {len(tokenizer)} entries, the model {VOCAB}")
    tokenizer.save_pretrained(out)
    build(seed).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote {make_copy_model(a.out, a.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
