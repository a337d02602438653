#!/usr/bin/env bash
# One device command: `pdllm eval` of the shipped model (its pdllm.json defaults), split into runs that each
# have their own time limit and save JSON/MD after every cell, so a cut-short run still leaves its rows.
# Usage (repo root): benchmarks/device_eval.sh [TASKS] [SAMPLES] [SECONDS_PER_RUN]
#   per task: pdllm at 0.5L..16L (longest first), vanilla at 0.5L..4L. Vanilla at 8L/16L costs ~44 s per
#   cell in fp32 on an H100: run it on its own, e.g. EXTRA="--methods vanilla --length-multiples 16,8
#   --dtype bfloat16".
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
tasks=${1:-needle,multidoc}; samples=${2:-20}; per=${3:-220}; out=${OUT:-/tmp/out}
mkdir -p "$out/eval"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
run() {  # NAME ARGS...
  local name=$1; shift
  timeout "$per" python -m pdllm.shared.app.eval --samples "$samples" --out "$out/eval" --name "$name" "$@" \
    2>"/tmp/$name.err" | tail -n 16
  tr '\r' '\n' < "/tmp/$name.err" | grep -v '^\s*$' | tail -n 2
}
IFS=, read -ra names <<< "$tasks"
for t in "${names[@]}"; do
  if [ -n "$EXTRA" ]; then
    # shellcheck disable=SC2086
    run "${t}_extra" --tasks "$t" $EXTRA
    continue
  fi
  run "${t}_pdllm" --tasks "$t" --methods pdllm --length-multiples 16,8,4,2,1,0.5
  run "${t}_vanilla" --tasks "$t" --methods vanilla --length-multiples 4,2,1,0.5
done
ls -la "$out/eval"
