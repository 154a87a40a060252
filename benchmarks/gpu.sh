#!/usr/bin/env bash
# The prefill-overhead and decode benchmarks on a CUDA GPU, in under 8 minutes on one recent GPU (model
# loads included, once the default model is converted: the first load converts it from GGUF).
# Raw results: benchmarks/runs/gpu/*.json and *.md; the tables are copied to docs/results/gpu/.
#   bash benchmarks/gpu.sh                 (from the repository root, with .venv active)
#   PYTHON=/path/to/python DEVICE=cuda:1 bash benchmarks/gpu.sh
# Each run is bounded (timeout), so one that hangs costs its slot, not the whole budget.
set -euo pipefail
PYTHON=${PYTHON:-python}
case $PYTHON in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac  # before the cd
cd "$(dirname "$0")"
DEVICE=${DEVICE:-cuda}
TABLES=../docs/results/gpu

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    "$PYTHON" -c "import torch; print(f'benchmarks/gpu.sh: torch {torch.__version__} sees no CUDA device (CUDA build: '
                  f'{torch.version.cuda or \"none, a CPU-only torch\"}); run it on a machine with an NVIDIA GPU '
                  f'and a CUDA build of torch (the CPU benchmarks: benchmarks/run_all.sh)')" >&2
    exit 2
fi
"$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"

start=$(date +%s)
run() {  # run <seconds> <script> <args...>: one bounded benchmark, its time printed
    local limit=$1; shift
    local t0=$(date +%s)
    timeout "$limit" "$PYTHON" "$@" --device "$DEVICE" || echo "!! $* failed or ran past ${limit}s (exit $?)" >&2
    echo "== $1 ${*: -1}: $(( $(date +%s) - t0 )) s (total $(( $(date +%s) - start )) s)" >&2
}

# prefill overhead: SmolLM2 fp32 and bf16 at 1K-8K, the paper's preset (the reference path at 1K),
# then the recommended preset (from_pretrained's default) at 4K and 8K
run 140 bench_prefill.py --plan smollm2-135m-instruct:float32:1024,2048,4096,8192:3,3,3,3:3,3,3,3 \
    smollm2-135m-instruct:bfloat16:1024,2048,4096,8192:3,3,3,3:3,3,3,3 --replays 3 --reference-up-to 1024 \
    --out gpu/prefill
run 80 bench_prefill.py --plan smollm2-135m-instruct:bfloat16:4096,8192:3,3:3,3 --preset recommended \
    --replays 3 --out gpu/prefill_recommended
# decode at 4K and 8K: full K/V vs materialized vs compact (read over its codes under sdpa; +codes: under
# the "varrate" attention)
run 80 bench_decode.py --configs full,materialized,compact,compact+codes --new 32 --repeats 3 --out gpu/decode
run 80 bench_decode.py --preset recommended --dtype bfloat16 --configs full,materialized,compact,compact+codes \
    --new 32 --repeats 3 --out gpu/decode_recommended_bf16
run 60 bench_decode.py --preset recommended --dtype bfloat16 --length 8192 --configs full,materialized,compact+codes \
    --new 32 --repeats 3 --out gpu/decode_recommended_bf16_8k

mkdir -p "$TABLES"
for table in runs/gpu/*.md; do
    [ -e "$table" ] && cp "$table" "$TABLES/"
done
echo "GPU benchmarks: $(( $(date +%s) - start )) s; tables in docs/results/gpu/" >&2
