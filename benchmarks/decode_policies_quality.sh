#!/usr/bin/env bash
# Quality of each decode policy on a checkpoint (benchmarks/results/decode_policies_quality/README.md): per
# policy P, `pdllm eval` on infilling and long-answer (vanilla and pdllm, every threshold, agreement with
# `none`, unmask schedules recorded) plus the needle for `none`; evals spread over the visible GPUs, at most
# PER_GPU at once on each (DyLLM and Polestar decode slowest). Results tarred into $OUT/quality.tgz.
# The default POLICIES are the Dream/LLaDA ones; on an SDAR checkpoint run POLICIES="none focus" (FOCUS runs
# on SDAR models only, and SDAR runs no other policy).
# Usage: [MODEL=dir] [BLOCK=32] [POLICIES="a b"] [SAMPLES=8] [T=seconds] [PER_GPU=4] bash THIS
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
M=${MODEL:-shared/checkpoints/pdllm-needle}; B=${BLOCK:-32}; O=/tmp/q; rm -rf $O; mkdir -p $O
T=${T:-420}; PER_GPU=${PER_GPU:-4}; SAMPLES=${SAMPLES:-8}
# the GPUs this script may use: the parent's CUDA_VISIBLE_DEVICES list, else every GPU of the host
IFS=, read -ra LANES <<< "${CUDA_VISIBLE_DEVICES:-$(python -c "import torch; print(','.join(map(str, range(max(1, torch.cuda.device_count())))))")}"
GPUS=${#LANES[@]}
E="python -m pdllm.shared.app.cli eval --model $M --train-length 1024 --out $O --eval-batch 24 --threshold none,0.7,0.8,0.9"
jobs_list=()
for p in ${POLICIES:-none dual-cache prefix-cache sparse-dllm polestar dyllm}; do
  ag=--agreement; [ "$p" = none ] && ag=
  for t in long-answer infilling; do
    jobs_list+=("--tasks $t --methods vanilla,pdllm --length-multiples 1 --depths 0,0.5,1 --samples $SAMPLES --block-length $B --decode-policy $p $ag --record-schedule $O/sched_${t}_$p.json --name ${t}_$p")
  done
done
# the needle answers in 8 tokens: blocks of 4
jobs_list+=("--tasks needle --methods vanilla,pdllm --length-multiples 1,4 --depths 0,0.5,1 --samples $SAMPLES --block-length 4 --decode-policy none --record-schedule $O/sched_needle_none.json --name needle_none")
i=0
for j in "${jobs_list[@]}"; do
  gpu=${LANES[$(( i % GPUS ))]}; name=${j##* }
  # wait for a slot: at most PER_GPU evals per GPU
  while [ "$(jobs -r | wc -l)" -ge $(( GPUS * PER_GPU )) ]; do sleep 2; done
  CUDA_VISIBLE_DEVICES=$gpu timeout "$T" $E $j > "$O/$name.log" 2>&1 &
  i=$(( i + 1 ))
done
wait
for f in $O/*.log; do echo "== $f"; tail -c 300 "$f" | tr '\r' '\n' | tail -2; done
(cd /tmp && tar czf "${OUT:-/tmp}/quality.tgz" q)
