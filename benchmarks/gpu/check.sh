#!/usr/bin/env bash
# The one prepared GPU check (under 8 minutes on one H100). Results land in $OUT (or the folder given as $1):
#   tests.log / tests.xml  the cuda-marked tests and the greedy-equality tests on device=cuda (float32)
#   kernels.txt            the kernels alone: paged attention and int8 linear against their alternatives
#   results.md / .json     benchmarks/gpu/bench_gpu.py: 1B- and 8B-shaped random Llamas in bfloat16
# On the GPU machine (no package registry) it first installs the wheels benchmarks/gpu/fetch_wheels.sh put in .whl/
# (carry .whl). DEVICE=cpu runs the CPU-side parts (the same scripts on a tiny model, no CUDA tests), as CI's
# test_gpu_check does. Paths that would start after the benchmark's budget are listed as skipped: compiling every
# path at both shapes does not fit 8 minutes, so a second call, SKIP_TESTS=1 (the 8B shape, a longer budget),
# measures what the first skipped. SKIP_TESTS=1 SHAPES=moe and SHAPES=gpt-oss measure the mixtures of experts
# (Qwen3-30B-A3B's and GPT-OSS-20B's layers: int8 experts, attention sinks).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${1:-benchmarks/gpu/out}}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# stops here, before any GPU minute is spent on tests, if torch or transformers is below hf_accel's floor (the image's
# own transformers is: carry .whl)
"$PY" - <<'PY' | tee "$OUT/env.txt" || exit 1
import sys
import torch, transformers
from hf_accel import UnsupportedVersionError
from hf_accel.core.versions import require_supported_versions
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
try:
    require_supported_versions()
except UnsupportedVersionError as err:
    sys.exit(f"check.sh: {err} (on the GPU machine: carry .whl)")
PY
status=0
if [ "$DEVICE" = cuda ] && [ "${SKIP_TESTS:-0}" = 1 ]; then
  SHAPES=${SHAPES:-8b} BUDGET=${BUDGET:-360} NEW=${NEW:-64} BACKEND=inductor BATCH=32
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}
elif [ "$DEVICE" = cuda ]; then
  # (a) about 2 minutes: every cuda-marked test (greedy equality on cuda included); only the files that hold them,
  # since others import packages the GPU image lacks (fastapi, openai, gguf)
  timeout 210 "$PY" -m pytest -q -m cuda tests/test_cuda.py tests/test_registry_patch.py tests/test_scaling.py \
    -p no:cacheprovider --junitxml "$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" || status=1
  # under two minutes: the kernels alone at 8B shapes in bf16 (paged attention: per-row reference, portable, Triton;
  # int8 linear at batch 1: float matmul, de-quantize form, Triton; last, FlexAttention's two compiles)
  timeout 120 "$PY" benchmarks/gpu/kernels_micro.py --device cuda --dtype bfloat16 --batch 32 --max-context 2048 \
    --heads 32 --kv-heads 8 --head-dim 128 --intermediate 14336 --rows 1 2>&1 | tee "$OUT/kernels.txt" || status=1
  SHAPES=${SHAPES:-1b,8b} BUDGET=${BUDGET:-180} NEW=${NEW:-64} BACKEND=inductor BATCH=32
else
  SHAPES=tiny BUDGET=0 NEW=8 BACKEND=eager BATCH=4
fi
# (b) the benchmark; paths that would start after the budget are listed as skipped
timeout ${BENCH_TIMEOUT:-210} "$PY" benchmarks/gpu/bench_gpu.py --device "$DEVICE" --shapes "$SHAPES" --new-tokens "$NEW" \
  --batch "$BATCH" --backend "$BACKEND" --budget-s "$BUDGET" --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
