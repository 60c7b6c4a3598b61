"""Make a real Hugging Face checkpoint locally: no model hub needed.

Writes `config.json`, `generation_config.json`, `model.safetensors`, and a
`tokenizer.json` (byte-level BPE trained with `tokenizers` on the Python standard
library's docstrings) with a chat template. The result loads offline with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`, exactly as a
downloaded checkpoint would. `--train-steps` trains it briefly on the same text so the
demo prints word-like output.

    python -m tools.make_model .cache/models/tiny-llama --arch llama --train-steps 300
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
import sysconfig
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ARCHS = ("llama", "qwen2", "gpt2")


def stdlib_docstrings(max_chars: int = 3_000_000) -> list[str]:
    """Docstrings of the running Python's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    texts.append(doc)
                    total += len(doc)
                    if total >= max_chars:
                        return texts
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on `texts`; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_config(arch: str, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, max_len: int, init: float):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    eos = 0  # <|endoftext|> is the first special token
    if arch == "llama":
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
            initializer_range=init, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
        )
    if arch == "qwen2":
        return Qwen2Config(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
            initializer_range=init, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True,
            use_sliding_window=False,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_len,
            initializer_range=init, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        )
    raise ValueError(f"--arch must be one of {list(ARCHS)}, got {arch!r}")


def make_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    vocab_size: int = 2048,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    max_len: int = 1024,
    init: float = 0.05,
    seed: int = 0,
    train_steps: int = 0,
    corpus_chars: int = 3_000_000,
    log=print,
) -> Path:
    """Write a checkpoint directory and return its path. See the module docstring."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = stdlib_docstrings(corpus_chars)
    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.save_pretrained(out)
    config = build_config(arch, len(tokenizer), hidden, layers, heads, kv_heads, max_len, init)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if train_steps:
        _train(model, tokenizer, texts, train_steps, max_len, log)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(out).iterdir():  # world-readable (the weights are written 0600): the
        f.chmod(0o644)               # checkpoint is mounted into containers that run as another user
    n_params = sum(p.numel() for p in model.parameters())
    log(f"wrote {arch} checkpoint ({n_params / 1e6:.2f}M params, vocab {len(tokenizer)}) to {out}")
    return out


def _train(model, tokenizer, texts: list[str], steps: int, max_len: int, log) -> None:
    """A few hundred AdamW steps of next-token prediction on the docstrings (CPU-friendly)."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t))
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    seq, batch = min(128, max_len), 16
    gen = torch.Generator().manual_seed(0)

    def loss_at(step: int):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        return model(input_ids=x, labels=x).loss

    fit(model, loss_at, steps, lr=3e-3, weight_decay=0.01, warmup=50, log=log)


def fit(model, loss_at, steps: int, *, lr: float, weight_decay: float, warmup: int, log, log_every: int = 50,
        what: str = "train step", loss_name: str = "loss") -> None:
    """`steps` AdamW steps on the scalar `loss_at(step)` (the tools' training loop: this
    file's, make_agent_model's, make_draft's), gradients clipped to norm 1, the learning
    rate warmed up linearly over `warmup` steps into a cosine decay; logged every
    `log_every` steps and at the last; the model is left in eval mode."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    t0 = time.time()
    for step in range(steps):
        loss = loss_at(step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            log(f"{what} {step + 1}/{steps} {loss_name} {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--init", type=float, default=0.05, help="initializer_range of the random init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-steps", type=int, default=0, help="train briefly so output looks like words")
    a = p.parse_args(argv)
    make_checkpoint(
        a.out_dir, arch=a.arch, vocab_size=a.vocab_size, hidden=a.hidden, layers=a.layers, heads=a.heads,
        kv_heads=a.kv_heads, max_len=a.max_len, init=a.init, seed=a.seed, train_steps=a.train_steps,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
