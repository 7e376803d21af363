#!/usr/bin/env bash
# Build head (working tree) and the trees in TREES under .before/; bench rows
# ROWS for BENCHES (tree:tag ...); ncu of NCU_OPS for NCU_TREES; GPU tests
# TESTS of head; sanitizers of head until DEADLINE. Logs in $OUT/logs.tar.gz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; O=$OUT/r; mkdir -p $O; S=$O/summary.txt
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $S
dir() { [ $1 = head ] && echo $ROOT || echo $ROOT/.before/$1; }
for t in head $TREES; do
  (cd $(dir $t) && MAX_JOBS=${JOBS_EACH:-5} python3 setup.py build_ext --inplace > $O/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s" >> $S) &
done
wait
bench() {  # tree tag
  d=$(dir $1)
  (cd $d && PYTHONPATH=$d timeout 100 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $ROWS \
     --out $O/bk_$1_$2.jsonl > $O/bk_$1_$2.txt 2>&1; echo "bench $1 $2 rc=$? at $(el) s" >> $S)
  grep -E "^ *[0-9]+  " $O/bk_$1_$2.txt | cut -c1-120 >> $S
}
for b in $BENCHES; do bench ${b%:*} ${b#*:}; done
for t in $NCU_TREES; do
  d=$(dir $t); mkdir -p /tmp/ncu_$t
  (cd $d && PYTHONPATH=$d timeout 120 ncu --profile-from-start off --cache-control none --import-source no \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
    --section SchedulerStats --section Occupancy --section LaunchStats --warp-sampling-interval 0 \
    -o /tmp/ncu_$t/r python3 $ROOT/.devrun/ncu_ops.py $NCU_OPS > $O/ncu_$t.txt 2>&1; echo "ncu $t rc=$? at $(el) s" >> $S)
  ncu -i /tmp/ncu_$t/r.ncu-rep --page details --csv > $O/ncu_details_$t.csv 2>&1
  ncu -i /tmp/ncu_$t/r.ncu-rep --page source --csv --print-source sass | gzip > $O/ncu_source_$t.csv.gz
  python3 $ROOT/benchmarks/ncu_stalls.py $O/ncu_source_$t.csv.gz > $O/ncu_stalls_$t.txt 2>&1
  grep -E "\"(DRAM Throughput|Memory Throughput|Duration|Issue Slots Busy|Executed Ipc Active|Achieved Occupancy|Registers Per Thread|Executed Instructions|No Eligible|Eligible Warps Per Scheduler|Active Warps Per Scheduler)\"" $O/ncu_details_$t.csv | awk -F'","' '{print $1, $(NF-2), $NF}' | cut -c1-120 >> $S
  head -3 $O/ncu_stalls_$t.txt | cut -c1-250 >> $S
done
cat $S
if [ -n "${TESTS:-}" ]; then
  RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=4 OUT=$O/tests_head timeout -s INT ${TEST_TIMEOUT:-150} bash scripts/gpu_check.sh \
    $TESTS -rfE > $O/tests_head.txt 2>&1
  echo "tests head rc=$? at $(el) s" >> $S; grep -E "passed|failed|FAILED|ERROR" $O/tests_head.txt | tail -6 | cut -c1-300 >> $S
fi
if [ $(el) -lt ${SAN_BEFORE:-440} ]; then
  OUT=$O/san RDNA4_COMM_SKIP_BUILD=1 timeout $(( ${DEADLINE:-575} - $(el) )) bash scripts/gpu_sanitize.sh > $O/sanitize.txt 2>&1
  echo "sanitize rc=$? at $(el) s" >> $S; grep -E "exit|SUMMARY|planted" $O/sanitize.txt | cut -c1-160 >> $S
fi
cp $S $OUT/summary.txt
(cd $OUT && tar -czf logs.tar.gz r && rm -rf r)
tail -25 $OUT/summary.txt
