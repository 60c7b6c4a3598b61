#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA machine lent for minutes that has torch,
# Triton and transformers but none of this project's other packages (no installs there:
# msgspec, the one more the engine imports, travels as a wheel in .whl/, made beforehand
# on the development box, see below). It runs, each under its own time limit so one that
# hangs leaves the rest their time:
#   1. the Triton kernel and engine tests on CUDA (tests/kernels/test_triton_attention.py,
#      test_triton_engine.py: kernels against the torch reference, the engine's greedy ids
#      against transformers' on the GPU);
#   2. tools/gpu_check.py (kernel correctness in bf16/fp16, decode bandwidth against the
#      card's peak, prefill TFLOP/s, then the engine on a random ~1.1B Llama: Triton vs torch,
#      decode graphs vs none, asynchronous vs sequential steps, compiled vs eager);
# and prints a digest. Everything lands in $OUT (default results/gpu), gpu_check.json
# rewritten after each of its parts.
#
#   on the development box, once:  python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec==0.23.0
#   on the GPU machine:            bash tools/gpu_check_lease.sh      (~8 min on one H200, expected)
#
# Checked on the development box against the GPU image's versions (torch 2.11, Triton 3.6,
# transformers 5.17, only msgspec added) with `--smoke` on the CPU; never run on a GPU yet.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 9
  export PYTHONPATH=/tmp/site:$PWD
fi
{ date -u; nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c 'import sys, torch, triton, transformers
print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)'
  nproc; free -g | head -2; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== 1. kernel and engine tests on CUDA"; SECONDS=0
timeout "${PYTEST_S:-150}" python3 -m pytest -q -x -p no:cacheprovider -o addopts="" --timeout 140 \
  tests/kernels/test_triton_attention.py tests/kernels/test_triton_engine.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? in ${SECONDS}s"; tail -15 "$OUT/pytest.txt"
echo "== 2. tools/gpu_check.py"; SECONDS=0
timeout "${GPU_CHECK_S:-360}" python3 -m tools.gpu_check --out "$OUT" > "$OUT/gpu_check.out" 2> "$OUT/gpu_check.err"
echo "gpu_check rc=$? in ${SECONDS}s"; grep -v "Loading weights" "$OUT/gpu_check.err" | tail -30
OUT=$OUT python3 - <<'PY'
import json, os

r = json.load(open(os.environ["OUT"] + "/gpu_check.json"))
print({k: r.get(k) for k in ("device", "all_correct", "failed", "wall_seconds")})
rows = r.get("correctness", [])
bad = [c for c in rows if isinstance(c, dict) and not c.get("ok")] if isinstance(rows, list) else rows
print("correctness rows", len(rows), "not ok", bad if isinstance(bad, dict) else bad[:3])
for k in ("decode_attention", "decode_attention_long_context"):
    d = r.get(k, {})
    print(k, {x: d.get(x) for x in ("gb_per_s", "percent_of_peak", "splits", "error")})
print("prefill", r.get("prefill_attention"))
for k, v in r.get("engine", {}).items():
    keep = ("output_tokens_per_s", "forward", "error", "identical", "median_first_divergence", "wall_with_start_seconds")
    print(k, {x: v.get(x) for x in keep} if isinstance(v, dict) else v)
PY
