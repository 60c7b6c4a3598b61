"""Make a draft model for speculative decoding (`serving_tuning.speculative.method: draft`)
from a local checkpoint: same architecture and tokenizer (the files are copied), fewer
layers, trained to say what the checkpoint says.

    python -m tools.make_draft .cache/models/bench-llama-trained .cache/models/bench-llama-draft --layers 1

Distillation (the default): the draft starts as the checkpoint cut to its first
`--layers` decoder layers (embeddings, final norm and output head kept: a layer-skip
start), then `--steps` AdamW steps minimise the KL divergence from the checkpoint's
next-token distribution to the draft's on the Python standard library's docstrings
(the text tools/make_model.py trains on), tokenized by the checkpoint's tokenizer. The
measure that matters is printed at the end: how often the draft's argmax equals the
checkpoint's on held-out text (greedy acceptance of one guess).

`--perturb SIGMA` instead writes the checkpoint itself with Gaussian noise of SIGMA times
each weight's standard deviation added: a draft that agrees with it often but not
always, for tests of the verification.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from tools.make_model import fit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "generation_config.json")


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def perturbed_copy(src: str | Path, out: str | Path, sigma: float, seed: int = 0) -> Path:
    """`src` with N(0, (sigma x std)^2) noise added to every floating weight, written to `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * sigma * float(p.std()))
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(src, out)
    return out


def distill(src: str | Path, out: str | Path, *, layers: int = 1, steps: int = 400, seq: int = 128, batch: int = 16,
            lr: float = 2e-3, corpus_chars: int = 1_500_000, seed: int = 0, log=print) -> dict:
    """Write a `layers`-layer draft of `src` to `out` (module docstring; `steps` 0: the cut
    alone); returns the held-out greedy agreement before and after training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.make_model import stdlib_docstrings

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    teacher = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    cfg = teacher.config.__class__.from_dict(teacher.config.to_dict())
    if not hasattr(cfg, "num_hidden_layers"):
        raise ValueError(f"{src}: no num_hidden_layers in its config; cannot cut it to {layers} layers")
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing = student.load_state_dict(teacher.state_dict(), strict=False).missing_keys  # the first layers + head
    if missing:
        raise ValueError(f"cutting {src} to {layers} layers left weights unset: {missing[:4]}")
    ids: list[int] = []
    for t in stdlib_docstrings(corpus_chars):
        ids.extend(tok.encode(t))
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    data = torch.tensor(ids, dtype=torch.long)
    held_out, data = data[-20 * seq:], data[: -20 * seq]
    gen = torch.Generator().manual_seed(seed)

    def agreement() -> float:
        x = held_out.view(-1, seq)
        with torch.no_grad():
            return float((student(input_ids=x).logits.argmax(-1) == teacher(input_ids=x).logits.argmax(-1))
                         .float().mean())

    before = agreement()
    if steps:
        _train(student, teacher, data, steps=steps, seq=seq, batch=batch, lr=lr, gen=gen, log=log)
    return _save(student, teacher, src, out, layers, before, agreement(), log)


def _train(student, teacher, data, *, steps: int, seq: int, batch: int, lr: float, gen, log) -> None:
    """`steps` AdamW steps on the KL divergence from the teacher's next-token distribution."""
    import torch
    import torch.nn.functional as F

    def loss_at(step: int):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s: s + seq] for s in starts])
        with torch.no_grad():
            target = F.log_softmax(teacher(input_ids=x).logits, -1)
        pred = F.log_softmax(student(input_ids=x).logits, -1)
        return F.kl_div(pred, target, log_target=True, reduction="batchmean") / seq

    fit(student, loss_at, steps, lr=lr, weight_decay=0.0, warmup=20, log=log, what="distill step", loss_name="KL")


def _save(student, teacher, src: Path, out: Path, layers: int, before: float, after: float, log) -> dict:
    student.generation_config = teacher.generation_config
    student.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(src, out)
    for f in out.iterdir():
        f.chmod(0o644)
    n = sum(p.numel() for p in student.parameters())
    log(f"wrote a {layers}-layer draft of {src} ({n / 1e6:.2f}M params) to {out}; held-out argmax agreement "
        f"with it {before:.3f} -> {after:.3f}")
    return {"agreement_before": before, "agreement_after": after, "params": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="the checkpoint the draft serves")
    p.add_argument("out", help="where the draft is written")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the draft")
    p.add_argument("--steps", type=int, default=400, help="distillation steps")
    p.add_argument("--perturb", type=float, default=None, metavar="SIGMA",
                   help="write the checkpoint with noise of SIGMA x each weight's std instead")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.perturb is not None:
        perturbed_copy(a.src, a.out, a.perturb, a.seed)
    else:
        distill(a.src, a.out, layers=a.layers, steps=a.steps, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
