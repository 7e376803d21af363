#!/usr/bin/env bash
# A kernel change against the code it changes, in one command on one GPU
# (docs/development.md, "Measuring a kernel change on one GPU"): the
# working tree (head) and a base tree unpacked under .before/base,
#   mkdir -p .before/base && git archive REV csrc rdna4_comm benchmarks \
#     scripts setup.py tests README.md | tar -x -C .before/base
# built side by side; head's GPU tests named in TESTS with ranks sharing
# the GPU, and the dist transport's expert placement alone; with
# SANITIZE=1, scripts/gpu_sanitize.sh of head; then
# benchmarks/bench_kernels.py of head, base, base, head, each in its own
# process, while the DEADLINE (seconds from the start) leaves room for one.
# Summaries on stdout, everything under $OUT (default results/ab), packed
# into $OUT/logs.tar.gz on exit, also when a `timeout` around the script
# stops it (a device call returns at most 8 files).
# Env: TESTS (default: tests/test_expert_layout.py tests/test_fp8_dispatch.py),
#      TEST_JOBS (pytest-xdist workers, 2), TEST_TIMEOUT (s, 170),
#      SANITIZE (0), BK_ROWS (bench_kernels rows; all if unset), DEADLINE (570).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
ROOT=$PWD
OUT=$(realpath -m "${OUT:-results/ab}")
mkdir -p "$OUT"
[ -f "$ROOT/.before/base/setup.py" ] || { echo "gpu_ab.sh: no base tree under .before/base (see the header)"; exit 2; }
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() { (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name logs.tar.gz -print0 | tar -czf logs.tar.gz --null -T - --remove-files); }
trap pack EXIT
trap 'echo "stopped at $(el) s"; exit 143' TERM INT
dir_of() { if [ $1 = head ]; then echo $ROOT; else echo $ROOT/.before/$1; fi; }
nvidia-smi --query-gpu=name --format=csv,noheader
for t in head base; do
  (cd $(dir_of $t) && MAX_JOBS=8 python3 setup.py build_ext --inplace > $OUT/build_$t.log 2>&1; echo "build $t rc=$? at $(el) s") &
done
wait
bench() {
  (cd $(dir_of $1) && PYTHONPATH=$(dir_of $1) timeout 150 python3 benchmarks/bench_kernels.py --rounds 3 --calls 30 ${BK_ROWS:+--rows $BK_ROWS} \
     --out $OUT/bk_$1_$2.jsonl > $OUT/bk_$1_$2.txt 2>&1; echo "bench $1 $2 rc=$? at $(el) s")
  grep -E "^ *[0-9]+  " $OUT/bk_$1_$2.txt | cut -c1-118
  grep -E "^  dc_expert|^  dc_decode:|^  combine_expert|^  dispatch_expert" $OUT/bk_$1_$2.txt
}
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=${TEST_JOBS:-2} OUT=$OUT/tests timeout -s INT ${TEST_TIMEOUT:-170} bash scripts/gpu_check.sh \
  ${TESTS:-tests/test_expert_layout.py tests/test_fp8_dispatch.py} -rfE > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(el) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests.txt | tail -6 | cut -c1-220
grep "^===" $OUT/tests/failures.txt 2>/dev/null | cut -c1-200
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_TRANSPORTS=dist OUT=$OUT/tests_dist timeout 40 bash scripts/gpu_check.sh \
  tests/test_expert_layout.py -k dist_alone -rfE > $OUT/tests_dist_alone.txt 2>&1
echo "dist alone rc=$? at $(el) s"; grep -E "passed|failed|FAILED|ERROR|skipped" $OUT/tests_dist_alone.txt | tail -4 | cut -c1-220
if [ "${SANITIZE:-0}" = 1 ]; then
  OUT=$OUT/san RDNA4_COMM_SKIP_BUILD=1 timeout 200 bash scripts/gpu_sanitize.sh > $OUT/sanitize.txt 2>&1
  echo "sanitize rc=$? at $(el) s"; grep -E "exit|SUMMARY|planted" $OUT/sanitize.txt | cut -c1-160
fi
bench head 1; bench base 1
[ $(el) -lt $(( ${DEADLINE:-570} - 130 )) ] && bench base 2
[ $(el) -lt $(( ${DEADLINE:-570} - 65 )) ] && bench head 2
echo "done at $(el) s"
