#!/usr/bin/env bash
# Device run for branch wip/next, first call (run from a checkout of it,
# .before/b091 = `git archive 091aebf`, main): build both; ep_kernel_times
# and bench_kernels of both (the one-wave placement grid, combine's column
# slices of pair rows, the placement's early prefetch, the FP8 loop's
# integer amax and hoisted addresses); ncu of the decode step's
# placement and pair-sum combine. Second call, on the warm machine:
# run8b.sh (tests, sanitizers).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
RES=$OUT; export OUT=/tmp/o; mkdir -p $OUT
trap 'tar czf $RES/run.tgz -C /tmp o' EXIT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
dir_of() { if [ $1 = head ]; then echo $ROOT; else echo $ROOT/.before/$1; fi; }
for t in head b091; do
  (cd $(dir_of $t) && MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
for t in head b091; do
  (cd $(dir_of $t) && PYTHONPATH=$(dir_of $t) timeout 40 python3 benchmarks/ep_kernel_times.py --alignment 1 > $OUT/ekt_$t.txt 2>&1; echo "ekt $t rc=$? at $(el) s")
  grep -E "per step|place|combine_kernel" $OUT/ekt_$t.txt | cut -c1-100
done
for t in head b091; do
  (cd $(dir_of $t) && PYTHONPATH=$(dir_of $t) timeout 130 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 \
     --out $OUT/bk_$t.jsonl > $OUT/bk_$t.txt 2>&1; echo "bench $t rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $OUT/bk_$t.txt | cut -c1-118
done
# Where the placement and the pair-sum combine of a decode step (T = 8, capacity 8: the script's first expert
# configuration) wait: ncu's warp states and source counters of one launch each.
for k in 'expert_place_kernel' 'combine_kernel<.*true>'; do
  PYTHONPATH=$ROOT timeout 50 ncu --kernel-name-base demangled --kernel-name regex:"$k" --launch-skip 2 --launch-count 1 \
    --section WarpStateStats --section LaunchStats --section Occupancy --section SourceCounters \
    python3 benchmarks/ep_kernel_times.py --alignment 1 >> $OUT/ncu_decode.txt 2>&1; echo "ncu $k rc=$? at $(el) s"
done
