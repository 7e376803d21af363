#!/usr/bin/env bash
# Installs what rdna4_comm's tests, demo and benchmarks need, then builds and
# installs the package in place (editable). Shared by scripts/test.sh and
# scripts/demo.sh; safe to run again (pip skips what is already there and the
# ninja build only recompiles changed sources).
#
#   bash scripts/install.sh
#
# The extension is built for the installed torch: CPU only with a CPU build of
# torch, plus the GPU transport with a CUDA or ROCm build (see README.md,
# "Building for GPUs"; RDNA4_COMM_BACKEND=cpu|cuda|rocm forces the backend).
set -euo pipefail

ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

pip_install() { python3 -m pip install --progress-bar off "$@"; }

if ! python3 -c "import torch" >/dev/null 2>&1; then
  # Pinned on purpose: this resolves to the CPU wheel available locally. An
  # unpinned "pip install torch" pulls a multi-GB CUDA build.
  echo "install: torch is missing; installing torch==2.13.0"
  pip_install torch==2.13.0
fi

# Build (setuptools with its own bdist_wheel, since --no-build-isolation builds
# with what is installed; ninja), tests (pytest, hypothesis; transformers for
# tests/test_transformers.py, the "transformers" extra in setup.py), benchmarks
# and demo (matplotlib, tqdm). Nothing that already satisfies these is upgraded.
pip_install "setuptools>=70.1" ninja pytest hypothesis "transformers>=5.18" matplotlib tqdm

# The build takes about two minutes on two cores and pip always rebuilds from
# scratch, so it is skipped while the installed package is this checkout's and
# its extension is newer than every source and than the installed torch.
# RDNA4_COMM_REBUILD=1 forces the build; so does setting any of the variables
# that choose what to build (RDNA4_COMM_BACKEND, TORCH_CUDA_ARCH_LIST,
# PYTORCH_ROCM_ARCH).
installed_here() {
  local so=(rdna4_comm/_C*.so) torch_init
  [ -e "${so[0]}" ] || return 1
  [ -z "${RDNA4_COMM_BACKEND:-}${TORCH_CUDA_ARCH_LIST:-}${PYTORCH_ROCM_ARCH:-}" ] || return 1
  torch_init="$(python3 -c 'import torch; print(torch.__file__)')" || return 1
  [ -z "$(find csrc setup.py "$torch_init" -newer "${so[0]}" -print -quit)" ] || return 1
  [ "$(cd / && python3 -c 'import os, rdna4_comm; print(os.path.dirname(os.path.realpath(rdna4_comm.__file__)))' 2>/dev/null)" \
    = "$(realpath rdna4_comm)" ]
}

if [ "${RDNA4_COMM_REBUILD:-0}" != 1 ] && installed_here; then
  echo "install: rdna4_comm is installed from $ROOT and up to date; not rebuilding (RDNA4_COMM_REBUILD=1 forces it)"
else
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  echo "install: building rdna4_comm in $ROOT (MAX_JOBS=$MAX_JOBS, torch $(python3 -c 'import torch; print(torch.__version__)'))"
  # --use-pep517: without it, older pip (23.x, as here) takes the legacy
  # "setup.py develop" route whenever the `wheel` package is installed, and
  # setuptools' develop shim then rebuilds in an isolated environment that
  # has no torch.
  pip_install --no-build-isolation --use-pep517 -e .
fi
python3 -c "import rdna4_comm as rc; print(f'install: rdna4_comm {rc.__version__} from {rc.__file__} (GPU support: {rc._C.with_gpu})')"
