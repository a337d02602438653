#!/usr/bin/env bash
# One device command for a candidate shipped model: train CONFIG on the whole GPU for MINUTES, run the quick
# needle check, and only if vanilla retrieves at the training length (>= GATE) run `pdllm eval` on the
# given tasks within EVAL_SECONDS. Everything worth keeping lands in $OUT (8 files at most come back).
# Usage (repo root): device_ship.sh MINUTES CONFIG [EVAL_SECONDS] [GATE] [TASKS]
#   TASKS: comma-separated `pdllm eval` tasks, each optionally `task=SECONDS` (its share of EVAL_SECONDS;
#   tasks without one split the rest evenly).
#   EVAL_ARGS_<task> (dashes as underscores): extra `pdllm eval` flags for that task. long-answer defaults to
#   L only, 5 depths x 4 samples, blocks of 32 (its answers are 128-256 tokens: ~0.5 s a decode on an H100).
#   QUICK_ARGS: extra quick_eval flags (e.g. fewer lengths: the gate reads vanilla at 1024 only); QUICK_S:
#   its time limit (default 100 s).
#   NPROC: GPUs to train on (default 1); above 1, torchrun trains one model data-parallel over NPROC GPUs
#   (each rank draws the config's tokens_per_batch, so the global batch is NPROC times it).
# shellcheck disable=SC2086  # QUICK_ARGS and EVAL_ARGS_* are flag lists, word-split on purpose
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
minutes=$1; cfg=$2; eval_s=${3:-150}; gate=${4:-0.5}; tasks=${5:-needle,multidoc}
out=${OUT:-/tmp/out}; run=/tmp/run/model; mkdir -p "$out"
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python -c "import pdllm.shared.training.train" || exit 3
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
launch=(python -m pdllm.shared.training.train)
if [ "${NPROC:-1}" -gt 1 ]; then
  launch=(python -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m pdllm.shared.training.train)
fi
"${launch[@]}" --config "$cfg" --out "$run" --max-minutes "$minutes" 2>&1 \
  | tr '\r' '\n' | grep -v '^\s*$' > "$out/train.log"
tail -n 5 "$out/train.log"
timeout "${QUICK_S:-100}" python -m pdllm.shared.training.quick_eval --model "$run/checkpoint" --samples 8 \
  --out "$out/quick_eval.json" ${QUICK_ARGS:-} 2>&1 | cut -c1-160
cp "$run/checkpoint/model.safetensors" "$out/" 2>/dev/null
# `pdllm eval` scores the candidate as it would ship: with the shipped model's pdllm.json (train length 1024,
# chunk size 256, top-3, sentence-aligned chunks), which the shipped results were measured with.
[ -f "$run/checkpoint/pdllm.json" ] || cp shared/checkpoints/pdllm-needle/pdllm.json "$run/checkpoint/"
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
  IFS=, read -ra items <<< "$tasks"
  rest=$eval_s; even=0
  for item in "${items[@]}"; do
    if [[ $item == *=* ]]; then rest=$(( rest - ${item#*=} )); else even=$(( even + 1 )); fi
  done
  EVAL_ARGS_long_answer=${EVAL_ARGS_long_answer-"--length-multiples 1 --depths 0,0.25,0.5,0.75,1 --samples 4 --block-length 32"}
  for item in "${items[@]}"; do
    t=${item%%=*}; per=$(( rest / (even > 0 ? even : 1) ))
    [[ $item == *=* ]] && per=${item#*=}
    extra_var="EVAL_ARGS_${t//-/_}"
    echo "== eval $t (${per}s): ${!extra_var:-}"
    timeout "$per" python -m pdllm.shared.app.cli eval --model "$run/checkpoint" --train-length 1024 \
      --tasks "$t" --out "$out/eval" --name "longctx_$t" ${!extra_var:-} 2>"/tmp/eval_$t.err" | tail -n 40
    tail -c 400 "/tmp/eval_$t.err" | tr '\r' '\n' | tail -n 2
  done
  (cd "$out" && tar czf eval.tgz eval && rm -rf eval)
fi
ls -la "$out"
