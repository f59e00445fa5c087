#!/usr/bin/env bash
# One GPU session's checks as one run on the device machine (the "Results (GPU)" section of benchmarks/RESULTS.md):
# the kernels' correctness and timing, then a short serving run. Run from the repository root there, with $OUT set and
# three folders carried from here, since that machine reaches no registry and has no redis-server:
#   .whl    wheels its image lacks (redis, hiredis, llguidance, gguf, transformers in this project's range),
#           fetched with `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`
#   .redis  bin/redis-server (a wrapper setting LD_LIBRARY_PATH) beside this machine's binary and its libraries
#   .smol   SmolLM2-135M-Instruct's tokenizer and config (`resolve_model_dir("smollm2-135m-instruct", False)`)
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.redis/bin:$PATH PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"
  redis-server --version; nproc; } 2>&1 | tee "$OUT/device.txt"
timeout "${KERNELS_TIMEOUT:-240}" python3 -m benchmarks.kernels_gpu --out "$OUT/kernels_gpu.json" 2>&1 | tee "$OUT/kernels_gpu.log"
timeout "${SERVING_TIMEOUT:-270}" python3 -m benchmarks.gpu_serving --out-dir "$OUT" --tokenizer .smol "$@" 2>&1 \
    | tee "$OUT/gpu_serving.log"
