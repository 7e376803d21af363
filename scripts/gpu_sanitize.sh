#!/usr/bin/env bash
# compute-sanitizer over every op: scripts/sanitize_ops.py (W = 2, ranks
# sharing the GPU where there is only one, eager and graph replay, checked
# against rdna4_comm.reference) under memcheck, racecheck and synccheck, each
# instrumenting every process (--target-processes all); then the same
# workload with a planted out-of-bounds store in rank 1, which memcheck must
# report, or the zero-error runs prove nothing.
#   bash scripts/gpu_sanitize.sh        (OUT: where the logs go)
# Builds first, as scripts/gpu_check.sh does; RDNA4_COMM_SKIP_BUILD=1 skips that.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
if [ "${RDNA4_COMM_SKIP_BUILD:-0}" != 1 ]; then
  RDNA4_COMM_SKIP_TESTS=1 bash scripts/gpu_check.sh > "$OUT/sanitize_build.txt" 2>&1 || { tail -30 "$OUT/sanitize_build.txt"; exit 2; }
fi
export RDNA4_COMM_ALLOW_SHARED_GPU=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
compute-sanitizer --version | head -2
status=0
for tool in memcheck racecheck synccheck; do
  log="$OUT/sanitize_$tool.log"
  start=$(date +%s)
  compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 3 \
    python3 scripts/sanitize_ops.py > "$log" 2>&1
  rc=$?
  # One summary for the whole process tree; the planted run below shows that
  # it covers the rank processes.
  echo "$tool: exit $rc, $(( $(date +%s) - start )) s:"
  grep -E "(ERROR|RACECHECK) SUMMARY|^sanitize_ops" "$log" | sed 's/^/  /'
  if [ "$rc" != 0 ] || ! grep -q "^sanitize_ops: every op checked" "$log"; then status=1; fi
done
log="$OUT/sanitize_planted.log"
compute-sanitizer --tool memcheck --target-processes all python3 scripts/sanitize_ops.py --plant-oob > "$log" 2>&1
# Reported in the store's kernel, from a spawned rank process (its host
# backtrace runs through multiprocessing's spawn_main and _rank_main).
if grep -q "Invalid __global__ write" "$log" && grep -q "spawn_main" "$log"; then
  echo "planted out-of-bounds store: reported"
  grep -E -A4 "Invalid __global__ write" "$log" | head -5 | sed 's/^/  /'
  grep -E "Host Frame: (every_op|_rank_main|spawn_main)" "$log" | head -3 | sed 's/^/  /'
  grep -E "ERROR SUMMARY" "$log" | sed 's/^/  /'
else
  echo "planted out-of-bounds store: NOT reported"
  status=1
fi
exit $status
