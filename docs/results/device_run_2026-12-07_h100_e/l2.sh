#!/usr/bin/env bash
# balance.py beside the build of the working tree (the build uses no GPU),
# then bench ROWS with RC_EXP_L2 set to each of SIZES.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
(timeout 200 python3 docs/results/device_run_2026-12-07_h100_e/balance.py 2>&1 | grep -v Warn > $OUT/balance.txt; echo "balance done at $(el) s") &
MAX_JOBS=14 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$? at $(el) s"
wait
cat $OUT/balance.txt
for sz in $SIZES; do
  PYTHONPATH=$PWD RC_EXP_L2=$sz timeout 100 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $ROWS --out $OUT/bk_$sz.jsonl > $OUT/bk_$sz.txt 2>&1
  echo "bench L2=$sz rc=$? at $(el) s"; grep -E "^ *[0-9]+  " $OUT/bk_$sz.txt | cut -c1-110; grep -A4 "device activities" $OUT/bk_$sz.txt | grep dispatch | cut -c1-150
done
