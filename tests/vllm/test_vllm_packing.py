"""The GPTQ and AWQ packings of `tools/make_quantized.py` (the writers behind
tests/engine/test_quantization.py's GPTQ and AWQ checkpoints) equal vLLM's own packers
(`pack_rows`, `pack_cols`, `awq_pack` of its quantization utilities), run in vLLM's
interpreter on the same values."""

from __future__ import annotations

import subprocess

import torch
from safetensors.torch import load_file, save_file

from tools.make_quantized import awq_pack, pack_int32

SCRIPT = """
import sys
from safetensors.torch import load_file, save_file
from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, pack_cols, pack_rows
values = load_file(sys.argv[1])
out = {}
for bits in (4, 8):
    q = values[f"q{bits}"]
    out[f"rows{bits}"] = pack_rows(q, bits, *q.shape)
    out[f"cols{bits}"] = pack_cols(q, bits, *q.shape)
out["awq4"] = awq_pack(values["q4"], 4, *values["q4"].shape)
save_file(out, sys.argv[2])
"""


def test_gptq_and_awq_packings_equal_vllms(vllm_python, tmp_path):
    gen = torch.Generator().manual_seed(0)
    values = {f"q{bits}": torch.randint(0, 1 << bits, (64, 48), generator=gen, dtype=torch.int32) for bits in (4, 8)}
    save_file(values, tmp_path / "values.safetensors")
    subprocess.run([vllm_python, "-c", SCRIPT, str(tmp_path / "values.safetensors"), str(tmp_path / "packed.safetensors")],
                   check=True, capture_output=True, timeout=240)
    theirs = load_file(tmp_path / "packed.safetensors")
    for bits in (4, 8):
        q = values[f"q{bits}"]
        assert torch.equal(pack_int32(q, bits, 0), theirs[f"rows{bits}"])  # GPTQ qweight: along the input channels
        assert torch.equal(pack_int32(q, bits, 1), theirs[f"cols{bits}"])  # GPTQ qzeros: along the outputs
    assert torch.equal(awq_pack(values["q4"]), theirs["awq4"])
