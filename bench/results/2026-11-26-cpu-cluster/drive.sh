#!/bin/bash
# Interleaved before/after runs of bench/cluster.py, one at a time, under a resolver that refuses at once.
OUT=/work/main/bench/results/2026-11-26-cpu-cluster
for size in $SIZES; do
  for i in $RUNS; do
    for which in old new; do
      if [ $which = old ]; then dir=/tmp/h5/old; pp=/tmp/h5/old/pkg  # git archive 8ef81e8, linked as pkg/ncclwatch; else dir=/work/main; pp=/work/main; fi
      echo "$(date +%T) $size $which $i" >> /tmp/h5/drive.log
      (cd $dir && "$(dirname "$0")"/nodns.sh env PYTHONPATH=$pp /work/main/.venv/bin/python bench/cluster.py --nodes $size --duration 5 --no-latency --procs 2 --hang-limit 240 --out $OUT/$which-$size-$i.json > /tmp/h5/run-$which-$size-$i.log 2>&1)
    done
  done
done
echo "$(date +%T) done" >> /tmp/h5/drive.log
