#!/usr/bin/env bash
# One device command: train the given configs side by side on one GPU, evaluate each, copy results to $OUT.
# Usage: device_train.sh MINUTES EVAL_SAMPLES CONFIG [CONFIG ...]   (run from the repo root)
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
minutes=$1; samples=$2; shift 2
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python -c "import pdllm.shared.training.train" || exit 3
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
pids=()
for cfg in "$@"; do
  name=$(basename "$cfg" .json)
  python -m pdllm.shared.training.train --config "$cfg" --out "/tmp/run/$name" --max-minutes "$minutes" \
    > "/tmp/run_$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for cfg in "$@"; do
  name=$(basename "$cfg" .json)
  tail -c 600 "/tmp/run_$name.log"; echo
  timeout 170 python -m pdllm.shared.training.quick_eval --model "/tmp/run/$name/checkpoint" \
    --out "/tmp/run/$name/quick_eval.json" --samples "$samples" > "/tmp/eval_$name.log" 2>&1 &
done
wait
for cfg in "$@"; do
  name=$(basename "$cfg" .json)
  echo "== $name"; grep '^{' "/tmp/eval_$name.log" | cut -c1-150
  mkdir -p "$OUT/$name"
  cp "/tmp/run/$name/checkpoint/model.safetensors" "$OUT/$name/" 2>/dev/null
  (cd "/tmp/run/$name" && tar czf "$OUT/$name/results.tgz" $(ls train_log.jsonl loss_curve.png summary.json \
    quick_eval.json checkpoint/config.json 2>/dev/null) -C /tmp "run_$name.log" "eval_$name.log")
done
ls -la "$OUT"/*
