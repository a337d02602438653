#!/usr/bin/env bash
# Quality of each decode policy on a checkpoint (benchmarks/results/decode_policies_quality/README.md):
# every eval in parallel on one GPU; results tarred into $OUT. Usage: [MODEL=dir] [T=seconds] [POLICIES="a b"] bash THIS
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
M=${MODEL:-shared/checkpoints/pdllm-needle}; O=/tmp/q; mkdir -p $O
E="python -m pdllm.shared.app.cli eval --model $M --train-length 1024 --out $O"
T=${T:-420}
for p in ${POLICIES:-none dual-cache prefix-cache sparse-dllm polestar}; do
  ag=--agreement; [ $p = none ] && ag=
  timeout $T $E --tasks long-answer --methods vanilla,pdllm --length-multiples 1 --depths 0,0.5,1 --samples 2 --block-length 32 --decode-policy $p $ag --name long_$p > $O/long_$p.log 2>&1 &
  timeout $T $E --tasks needle --methods pdllm --length-multiples 16,1 --depths 0,0.25,0.5,0.75,1 --samples 8 --block-length 4 --decode-policy $p $ag --name needle_$p > $O/needle_$p.log 2>&1 &
done
wait
for f in $O/*.log; do echo "== $f"; tail -c 300 $f | tr '\r' '\n' | tail -2; done
(cd /tmp && tar czf $OUT/quality.tgz q)
