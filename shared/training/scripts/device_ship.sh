#!/usr/bin/env bash
# One device command for a candidate shipped model: train CONFIG on the whole GPU for MINUTES, run the quick
# needle check, and only if vanilla retrieves at the training length (>= GATE) run `pdllm eval` on the
# given tasks within EVAL_SECONDS. Everything worth keeping lands in $OUT (8 files at most come back).
# Usage (repo root): device_ship.sh MINUTES CONFIG [EVAL_SECONDS] [GATE] [TASKS]
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
minutes=$1; cfg=$2; eval_s=${3:-150}; gate=${4:-0.5}; tasks=${5:-needle,multidoc}
out=${OUT:-/tmp/out}; run=/tmp/run/model; mkdir -p "$out"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python -c "import pdllm.shared.training.train" || exit 3
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python -m pdllm.shared.training.train --config "$cfg" --out "$run" --max-minutes "$minutes" 2>&1 \
  | tr '\r' '\n' | grep -v '^\s*$' > "$out/train.log"
tail -n 5 "$out/train.log"
timeout 100 python -m pdllm.shared.training.quick_eval --model "$run/checkpoint" --samples 8 \
  --out "$out/quick_eval.json" 2>&1 | cut -c1-160
cp "$run/checkpoint/model.safetensors" "$out/" 2>/dev/null
(cd "$run" && tar czf "$out/run.tgz" $(ls train_log.jsonl loss_curve.png summary.json checkpoint/config.json))
acc=$(python - "$out/quick_eval.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError):
    print(0.0); raise SystemExit
cell = [r["accuracy"] for r in rows if r["method"] == "vanilla" and r["context_length"] == 1024]
print(sum(cell) / max(1, len(cell)))
EOF
)
echo "vanilla accuracy at 1024: $acc (gate $gate)"
if python -c "import sys; sys.exit(0 if float('$acc') >= float('$gate') else 1)"; then
  mkdir -p "$out/eval"
  IFS=, read -ra names <<< "$tasks"
  per=$(( eval_s / ${#names[@]} ))
  for t in "${names[@]}"; do
    timeout "$per" python -m pdllm.shared.app.cli eval --model "$run/checkpoint" --train-length 1024 \
      --tasks "$t" --out "$out/eval" --name "longctx_$t" 2>"/tmp/eval_$t.err" | tail -n 12
    tail -c 400 "/tmp/eval_$t.err" | tr '\r' '\n' | tail -n 2
  done
  (cd "$out" && tar czf eval.tgz eval && rm -rf eval)
fi
ls -la "$out"
