#!/usr/bin/env bash
# One device command: build head, base and trace trees; bench rows of head
# and base; the trace tree's phase trace; GPU tests of head (ranks sharing
# the GPU); sanitizers of head; ncu warp stalls of head (regex NCU_K) while
# time is left. Summaries last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; O=$OUT/ex; mkdir -p $O
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
(cd $ROOT && MAX_JOBS=8 python3 setup.py build_ext --inplace > $O/build_head.log 2>&1; echo "build head rc=$? at $(el) s" >> $O/summary.txt) &
(cd $ROOT/.before/base && MAX_JOBS=5 python3 setup.py build_ext --inplace > $O/build_base.log 2>&1; echo "build base rc=$? at $(el) s" >> $O/summary.txt) &
(cd $ROOT/.before/trace && MAX_JOBS=4 python3 setup.py build_ext --inplace > $O/build_trace.log 2>&1; echo "build trace rc=$? at $(el) s" >> $O/summary.txt) &
wait
for t in head base; do
  d=$ROOT; [ $t = base ] && d=$ROOT/.before/base
  (cd $d && PYTHONPATH=$d timeout 150 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $BK_ROWS \
     --out $O/bk_$t.jsonl > $O/bk_$t.txt 2>&1; echo "bench $t rc=$? at $(el) s" >> $O/summary.txt)
  grep -E "^ *[0-9]+  " $O/bk_$t.txt | cut -c1-130 >> $O/summary.txt
  grep -E "^  (dc_expert|dc_decode|combine_expert|dispatch_expert|copy_pairs|read_pairs)" $O/bk_$t.txt >> $O/summary.txt
done
(cd $ROOT/.before/trace && PYTHONPATH=$ROOT/.before/trace timeout 90 python3 $ROOT/.devrun/trace_decode.py > $O/trace.txt 2>&1; echo "trace rc=$? at $(el) s" >> $O/summary.txt)
awk '/^=== dc/{p=1; n=0} p && /^TR/{n++; if (n > 2 * 113) next} p' $O/trace.txt | grep -E "^===|blk (0|1|7|8|9|50|112)/" | head -40 | cut -c1-260 >> $O/summary.txt
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=${TEST_JOBS:-4} OUT=$O/tests timeout -s INT ${TEST_TIMEOUT:-180} bash scripts/gpu_check.sh \
  $TESTS -rfE > $O/tests.txt 2>&1
echo "tests rc=$? at $(el) s" >> $O/summary.txt
grep -E "passed|failed|FAILED|ERROR" $O/tests.txt | tail -8 | cut -c1-300 >> $O/summary.txt
if [ $(el) -lt ${SAN_BEFORE:-420} ]; then
  OUT=$O/san RDNA4_COMM_SKIP_BUILD=1 timeout $(( ${DEADLINE:-570} - $(el) )) bash scripts/gpu_sanitize.sh > $O/sanitize.txt 2>&1
  echo "sanitize rc=$? at $(el) s" >> $O/summary.txt; grep -E "exit|SUMMARY|planted" $O/sanitize.txt | cut -c1-160 >> $O/summary.txt
fi
if [ -n "${NCU_K:-}" ] && [ $(el) -lt $(( ${DEADLINE:-570} - 70 )) ]; then
  mkdir -p /tmp/ncu && (cd /tmp/ncu && PYTHONPATH=$ROOT timeout $(( ${DEADLINE:-570} - $(el) - 15 )) ncu --profile-from-start off --cache-control none --import-source no \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --warp-sampling-interval 0 \
    -k regex:"$NCU_K" -o stalls python3 $ROOT/benchmarks/bench_kernels.py --ncu-child > $O/ncu.txt 2>&1
  echo "ncu rc=$? at $(el) s" >> $O/summary.txt
  ncu -i stalls.ncu-rep --page source --csv --print-source sass | gzip > $O/stalls.csv.gz && python3 $ROOT/benchmarks/ncu_stalls.py $O/stalls.csv.gz > $O/ncu_stalls.txt 2>&1
  echo "stalls at $(el) s" >> $O/summary.txt)
fi
cat $O/summary.txt
