#!/usr/bin/env bash
# One device command: build head and base, GPU tests of head (ranks sharing
# the GPU), bench_kernels rows of head and base, then the sanitizers of head
# while time is left. Summaries last on stdout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; O=$OUT/ex; mkdir -p $O
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
(cd $ROOT && MAX_JOBS=10 python3 setup.py build_ext --inplace > $O/build_head.log 2>&1; echo "build head rc=$? at $(el) s" >> $O/summary.txt) &
(cd $ROOT/.before/base && MAX_JOBS=6 python3 setup.py build_ext --inplace > $O/build_base.log 2>&1; echo "build base rc=$? at $(el) s" >> $O/summary.txt) &
wait
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=${TEST_JOBS:-4} OUT=$O/tests timeout -s INT ${TEST_TIMEOUT:-180} bash scripts/gpu_check.sh \
  $TESTS -rfE > $O/tests.txt 2>&1
echo "tests rc=$? at $(el) s" >> $O/summary.txt
grep -E "passed|failed|FAILED|ERROR" $O/tests.txt | tail -8 | cut -c1-300 >> $O/summary.txt
for t in head base; do
  d=$ROOT; [ $t = base ] && d=$ROOT/.before/base
  (cd $d && PYTHONPATH=$d timeout 120 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $BK_ROWS \
     --out $O/bk_$t.jsonl > $O/bk_$t.txt 2>&1; echo "bench $t rc=$? at $(el) s" >> $O/summary.txt)
  grep -E "^ *[0-9]+  " $O/bk_$t.txt | cut -c1-130 >> $O/summary.txt
  grep -E "^  (dc_expert|dc_decode|combine_expert|dispatch_expert|copy_pairs|read_pairs)" $O/bk_$t.txt >> $O/summary.txt
done
if [ $(el) -lt ${SAN_BEFORE:-380} ]; then
  OUT=$O/san RDNA4_COMM_SKIP_BUILD=1 timeout $(( ${DEADLINE:-560} - $(el) )) bash scripts/gpu_sanitize.sh > $O/sanitize.txt 2>&1
  echo "sanitize rc=$? at $(el) s" >> $O/summary.txt; grep -E "exit|SUMMARY|planted" $O/sanitize.txt | cut -c1-160 >> $O/summary.txt
fi
cat $O/summary.txt
