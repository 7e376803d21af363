#!/usr/bin/env bash
# Build the GPU extension in place and run the GPU test suite on a machine
# with 2+ GPUs (or one, with RDNA4_COMM_ALLOW_SHARED_GPU=1: ranks share it).
# Used on the device machines:
#   bash scripts/gpu_check.sh [pytest args...]
# (test paths among the args, tests/...: only those run; else the whole suite)
# Env: RDNA4_COMM_TEST_EXAMPLES (hypothesis example scale, default 0.3 here),
#      RDNA4_COMM_TEST_JOBS (N > 1: test files in N pytest-xdist workers, each
#        with worlds of its own, so the whole suite fits one device command;
#        the deadlines of test_faults and the soak then run on a loaded machine),
#      OUT (directory for logs; default ./gpu_check_out; each failure is
#        written to $OUT/failures.txt as it happens, for runs cut off by a
#        time limit before pytest's summary).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The CUDA image's default compiler (CXX=/opt/gcc/bin/g++) links libstdc++
# statically into the extension; its second copy of the iostreams crashes the
# first time the extension formats a message (every TORCH_CHECK). Build with
# the system compiler, which links libstdc++ dynamically like torch does.
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
nvidia-smi -L || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
start=$(date +%s)
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
python3 -c "import rdna4_comm as rc; assert rc._C.with_gpu, 'built without GPU support'; print('with_gpu', rc._C.with_gpu)"
[ "${RDNA4_COMM_SKIP_TESTS:-0}" = 1 ] && exit 0
targets=(tests)
for arg in "$@"; do case "$arg" in tests/*) targets=(); break ;; esac; done
jobs=()
if [ "${RDNA4_COMM_TEST_JOBS:-1}" -gt 1 ]; then
  python3 -c "import xdist" 2>/dev/null || { echo "RDNA4_COMM_TEST_JOBS needs pytest-xdist"; exit 1; }
  jobs=(-n "$RDNA4_COMM_TEST_JOBS" --dist loadfile)
fi
: > "$OUT/failures.txt"
RDNA4_COMM_FAILURES="$OUT/failures.txt" RDNA4_COMM_TEST_TRANSPORTS="${RDNA4_COMM_TEST_TRANSPORTS:-gpu}" RDNA4_COMM_TEST_EXAMPLES="${RDNA4_COMM_TEST_EXAMPLES:-0.3}" \
  python3 -m pytest ${targets[@]+"${targets[@]}"} -q -p no:warnings -p no:cacheprovider ${jobs[@]+"${jobs[@]}"} "$@" 2>&1 | tee "$OUT/tests.log"
