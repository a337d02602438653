#!/usr/bin/env bash
# One device command: `pdllm eval` of the shipped model, one task at a time (each within its own time
# limit, longest contexts first so the 16x row lands even if a task is cut short), results under $OUT.
# Usage (repo root): benchmarks/device_eval.sh SECONDS_PER_TASK [TASKS] [SAMPLES]
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
per=${1:-200}; tasks=${2:-needle,multidoc}; samples=${3:-20}; out=${OUT:-/tmp/out}
mkdir -p "$out/eval"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
IFS=, read -ra names <<< "$tasks"
for t in "${names[@]}"; do
  timeout "$per" python -m pdllm.shared.eval.run --train-length 1024 --tasks "$t" --samples "$samples" \
    --length-multiples 16,8,4,2,1,0.5 --out "$out/eval" --name "longctx_$t" 2>"/tmp/eval_$t.err" | tail -n 16
  tr '\r' '\n' < "/tmp/eval_$t.err" | grep -v '^\s*$' | tail -n 3
done
ls -la "$out/eval"
