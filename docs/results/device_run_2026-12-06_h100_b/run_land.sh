#!/usr/bin/env bash
# The working tree, to land: build, scripts/gpu_sanitize.sh, the whole GPU
# suite with ranks sharing the GPU, ncu warp stalls of the decode step's
# placement and pair-sum combine, then bench_moe_layer (the HF layer, both
# layouts, T = 8, 128, 4096) until the deadline. Everything under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0
ROOT=$PWD
mkdir -p $OUT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name --format=csv,noheader
MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo "build rc=$? at $(el) s"
OUT=/tmp/san RDNA4_COMM_SKIP_BUILD=1 timeout 150 bash scripts/gpu_sanitize.sh > $OUT/sanitize.txt 2>&1
echo "sanitize rc=$? at $(el) s"; grep -E "exit|SUMMARY|planted" $OUT/sanitize.txt | cut -c1-160
RDNA4_COMM_ALLOW_SHARED_GPU=1 RDNA4_COMM_TEST_JOBS=12 RDNA4_COMM_TEST_EXAMPLES=0.15 OUT=/tmp/suite timeout -s INT 260 \
  bash scripts/gpu_check.sh --timeout 200 -rfE --ignore=tests/test_vllm.py --ignore=tests/test_vllm_plugin.py \
  --ignore=tests/test_hip_compile.py --ignore=tests/test_cuda_compile.py > $OUT/suite.txt 2>&1
echo "suite rc=$? at $(el) s"; grep -v "Warning\|warner" $OUT/suite.txt | tail -8 | cut -c1-200
grep "^===" /tmp/suite/failures.txt 2>/dev/null | cut -c1-200
mkdir -p /tmp/ncu && cd /tmp/ncu && PYTHONPATH=$ROOT timeout 110 ncu --profile-from-start off --cache-control none --import-source no \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --warp-sampling-interval 0 \
  -k regex:"expert_place_kernel|combine_kernel" -o stalls python3 $ROOT/benchmarks/bench_kernels.py --ncu-child > ncu.txt 2>&1
echo "ncu rc=$? at $(el) s"; tail -2 ncu.txt | cut -c1-200
ncu -i stalls.ncu-rep --page source --csv --print-source sass | gzip > stalls.csv.gz && python3 $ROOT/benchmarks/ncu_stalls.py stalls.csv.gz > $OUT/ncu_stalls.txt 2>&1
echo "stalls at $(el) s"; cd $ROOT
# The decode steps' kernels, in NCU_OPS order: dc_expert_decode's placement and combine (the 6th combine launch).
awk '/^void /{n++} n>=1' $OUT/ncu_stalls.txt | grep -n "^void" | cut -c1-160
left=$(( ${DEADLINE:-580} - $(el) ))
[ $left -gt 60 ] && PYTHONPATH=$ROOT timeout $left python3 benchmarks/bench_moe_layer.py --transport gpu --world 1 --hidden 7168 \
  --tokens 8 128 4096 --rounds 3 --samples 20 --out $OUT/bench_moe_layer.jsonl > $OUT/bench_moe_layer.txt 2>&1
echo "moe layer rc=$? at $(el) s"; grep -v "^bench_moe_layer: \(case\|world\)" $OUT/bench_moe_layer.txt | tail -24 | cut -c1-170
