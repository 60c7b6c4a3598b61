"""Make a LoRA adapter in PEFT's format for a local checkpoint, with random weights large
enough to change its output: for tests, benchmarks and trying `model.lora_dir`.

    python -m tools.make_lora --base .cache/test-models/tiny-llama-v1 --out loras/style --rank 8

A real adapter comes from fine-tuning with `peft` (`PeftModel.save_pretrained`); this
writes the same files (`adapter_config.json`, `adapter_model.safetensors`).
"""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: str | Path, out: str | Path, rank: int, *, seed: int | None = None, std: float = 0.1,
                 targets: tuple[str, ...] = ALL_PROJECTIONS, alpha: float | None = None, **lora_kwargs) -> Path:
    """Write a random LoRA adapter for checkpoint `base` into directory `out` (made).

    A and B ~ N(0, std) (PEFT's own init zeroes B: no change to the output), scale
    `alpha / rank` (alpha default 2 x rank). `seed` None: derived from the directory's
    name, so adapters of different names differ. `lora_kwargs` go to `peft.LoraConfig`
    (`use_rslora`, `alpha_pattern`, `rank_pattern`, `use_dora`, ...).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(out)
    torch.manual_seed(zlib.crc32(out.name.encode()) if seed is None else seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=list(targets),
                     init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    peft_model.save_pretrained(str(out))
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the base model's checkpoint directory")
    ap.add_argument("--out", required=True, help="the adapter's directory: <model.lora_dir>/<adapter name>")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=None, help="default: derived from the adapter's directory name")
    ap.add_argument("--std", type=float, default=0.1, help="standard deviation of the random A and B")
    ap.add_argument("--targets", default=",".join(ALL_PROJECTIONS), help="comma-separated projection names")
    args = ap.parse_args()
    out = make_adapter(args.base, args.out, args.rank, seed=args.seed, std=args.std,
                       targets=tuple(t for t in args.targets.split(",") if t))
    print(f"adapter written to {out}")


if __name__ == "__main__":
    main()
