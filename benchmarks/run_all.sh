#!/usr/bin/env bash
# Every benchmark with its default plan, one after the other (about 30 min on 2 busy CPU cores),
# then the summary table. Results: benchmarks/runs/*.json and *.md, SUMMARY.md (not tracked; the numbers
# the README cites are copied to docs/results/benchmarks/).
#   bash benchmarks/run_all.sh            (from the repository root, with .venv active)
set -euo pipefail
cd "$(dirname "$0")"
start=$(date +%s)
python bench_prefill.py
python bench_prefill.py --plan smollm2-135m-instruct:float32:2048,4096:2,3:1,1 --preset recommended --out prefill_recommended
python bench_decode.py --configs full,materialized,compact,compact+codes,compact+codes+torch,compact-4bit,compact-4bit+codes --repeats 5
python bench_decode.py --configs full,materialized,compact,compact-4bit --threads 2 --out decode_2threads
python bench_decode.py --preset recommended --configs full,materialized,compact,compact+codes,compact+codes+torch --repeats 5 --out decode_recommended
python bench_decode.py --preset recommended --threads 2 --configs full,materialized,compact+codes,compact+codes+torch --repeats 5 --out decode_recommended_2threads
python bench_decode.py --preset recommended --dtype bfloat16 --configs full,materialized,compact+codes,compact+codes+torch --repeats 3 --out decode_recommended_bf16
python bench_decode.py --dtype bfloat16 --configs full,materialized,compact,compact+codes --out decode_bf16
python bench_decode.py --model gemma-3-270m --configs full,materialized,compact,compact+codes,compact+codes+torch --out decode_gemma
python bench_read.py --preset recommended
python bench_memory.py
python bench_load.py
python bench_footprint.py
python bench_versions.py        # before / after against the first codec (5 min)
python summarize.py
echo "all benchmarks: $(( $(date +%s) - start )) s"
