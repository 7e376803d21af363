#!/usr/bin/env bash
# One device command: build head (working tree), .before/base (main) and
# .before/br (the expert branch); bench rows HEAD_ROWS of head and base
# (head, base, head), rows BR_ROWS of br and base; GPU tests of head (TESTS)
# and of br (BR_TESTS), ranks sharing the GPU; memcheck of head while time
# is left. Logs in $OUT/logs.tar.gz, summary on stdout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD; O=$OUT/pf; mkdir -p $O; S=$O/summary.txt
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $S
dir() { [ $1 = head ] && echo $ROOT || echo $ROOT/.before/$1; }
(cd $ROOT && MAX_JOBS=7 python3 setup.py build_ext --inplace > $O/build_head.log 2>&1; echo "build head rc=$? at $(el) s" >> $S) &
(cd $ROOT/.before/base && MAX_JOBS=5 python3 setup.py build_ext --inplace > $O/build_base.log 2>&1; echo "build base rc=$? at $(el) s" >> $S) &
(cd $ROOT/.before/br && MAX_JOBS=4 python3 setup.py build_ext --inplace > $O/build_br.log 2>&1; echo "build br rc=$? at $(el) s" >> $S) &
wait
bench() {  # tree tag rows
  d=$(dir $1)
  (cd $d && PYTHONPATH=$d timeout 100 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 --rows $3 \
     --out $O/bk_$1_$2.jsonl > $O/bk_$1_$2.txt 2>&1; echo "bench $1 $2 rc=$? at $(el) s" >> $S)
  grep -E "^ *[0-9]+  " $O/bk_$1_$2.txt | cut -c1-120 >> $S
  grep -E "^  (dispatch|combine|dispatch_fp8|dispatch_fp8_pair|dc_expert_decode|dc_expert_decode_bigcap): " $O/bk_$1_$2.txt >> $S
}
bench head 1 "$HEAD_ROWS"; bench base 1 "$HEAD_ROWS"
[ -n "$BR_ROWS" ] && { bench br 1 "$BR_ROWS"; bench base 2 "$BR_ROWS"; }
cat $S
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=4 OUT=$O/tests_head timeout -s INT ${TEST_TIMEOUT:-150} bash scripts/gpu_check.sh \
  $TESTS -rfE > $O/tests_head.txt 2>&1
echo "tests head rc=$? at $(el) s" >> $S; grep -E "passed|failed|FAILED|ERROR" $O/tests_head.txt | tail -6 | cut -c1-300 >> $S
[ -n "$BR_TESTS" ] && (cd $ROOT/.before/br && RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=4 OUT=$O/tests_br timeout -s INT ${BR_TIMEOUT:-120} bash scripts/gpu_check.sh \
  $BR_TESTS -rfE > $O/tests_br.txt 2>&1; echo "tests br rc=$? at $(el) s" >> $S)
[ -n "$BR_TESTS" ] && grep -E "passed|failed|FAILED|ERROR" $O/tests_br.txt | tail -6 | cut -c1-300 >> $S
if [ $(el) -lt ${SAN_BEFORE:-440} ]; then
  OUT=$O/san RDNA4_COMM_SKIP_BUILD=1 timeout $(( ${DEADLINE:-575} - $(el) )) bash scripts/gpu_sanitize.sh > $O/sanitize.txt 2>&1
  echo "sanitize rc=$? at $(el) s" >> $S; grep -E "exit|SUMMARY|planted" $O/sanitize.txt | cut -c1-160 >> $S
fi
cp $S $OUT/summary.txt
(cd $OUT && tar -czf logs.tar.gz pf && rm -rf pf)
tail -15 $OUT/summary.txt
