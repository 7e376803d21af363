#!/usr/bin/env bash
# Installs what rdna4_comm needs, then builds and installs the package in
# place (editable). Shared by scripts/demo.sh and scripts/test.sh; safe to run
# again (requirements already met are not asked of the package index, and
# the build is skipped while it is up to date).
#
#   bash scripts/install.sh demo   # torch and the build tools: what the demo needs
#   bash scripts/install.sh test   # also the test and benchmark tools (default)
#
# Into whatever python3 is first on PATH: use a virtual environment
# (README.md, "Quickstart"). The extension is built for the installed torch:
# CPU only with a CPU build of torch, plus the GPU transport with a CUDA or
# ROCm build (README.md, "Building for GPUs"; RDNA4_COMM_BACKEND=cpu|cuda|rocm
# forces the backend).
set -euo pipefail

ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PROFILE="${1:-test}"
case "$PROFILE" in
  demo) ;;
  test) ;;
  *) echo "install: the profile must be 'demo' or 'test', got '$PROFILE'" >&2; exit 2 ;;
esac

pip_install() { python3 -m pip install --progress-bar off "$@"; }

if ! python3 -c "import torch" >/dev/null 2>&1; then
  # Pinned on purpose: this resolves to the CPU wheel available locally. An
  # unpinned "pip install torch" pulls a multi-GB CUDA build.
  echo "install: torch is missing; installing torch==2.13.0"
  pip_install torch==2.13.0
fi

# The build: setuptools with its own bdist_wheel (--no-build-isolation builds
# with what is installed) and ninja. numpy: torch runs without it but warns
# at every import that it is missing. The tests and benchmarks: pytest,
# pytest-xdist (scripts/test.sh's workers; 3.8 for --no-loadscope-reorder), hypothesis, transformers
# (tests/test_transformers.py; the "transformers" extra in setup.py),
# matplotlib (heatmaps), tqdm (progress bars).
requirements=("setuptools>=70.1" ninja numpy)
[ "$PROFILE" = test ] && requirements+=(pytest "pytest-xdist>=3.8" hypothesis "transformers>=5.18" matplotlib tqdm)

# The requirements this environment does not meet yet, checked locally, so a
# second run does not ask the package index again.
missing=$(python3 - "${requirements[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

from pip._vendor.packaging.requirements import Requirement

for text in sys.argv[1:]:
    req = Requirement(text)
    try:
        if req.specifier.contains(version(req.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    print(text)
EOF
)
if [ -n "$missing" ]; then
  echo "install: installing $(echo $missing)"
  # shellcheck disable=SC2086  # one requirement per word
  pip_install $missing
else
  echo "install: ${requirements[*]}: already installed"
fi

# The build takes 1-2 minutes on two cores and pip always rebuilds from
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

# The compile steps as ninja finishes them ("[3/6] csrc/ep_layouts.cpp"),
# from pip's verbose output (kept whole in the log). Without a terminal,
# ninja prints a step's line when the step ends: "  [3/6] c++ ... -c SOURCE".
progress() {
  local start=$SECONDS step
  while IFS= read -r line; do
    if [[ "$line" =~ ^[[:space:]]*[^[:space:]]+[[:space:]].*[[:space:]]-shared[[:space:]] ]]; then
      echo "install: linking rdna4_comm/_C ($((SECONDS - start)) s)"
      continue
    fi
    [[ "$line" =~ ^[[:space:]]*\[([0-9]+/[0-9]+)\][[:space:]] ]] || continue
    step="${BASH_REMATCH[1]}"
    [[ "$line" =~ [[:space:]]-c[[:space:]]+([^-[:space:]][^[:space:]]*) ]] || continue
    echo "install: compiled $step ${BASH_REMATCH[1]#"$ROOT"/} ($((SECONDS - start)) s)"
  done
}

if [ "${RDNA4_COMM_REBUILD:-0}" != 1 ] && installed_here; then
  echo "install: rdna4_comm is installed from $ROOT and up to date; not rebuilding (RDNA4_COMM_REBUILD=1 forces it)"
else
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  log="$(mktemp -t rdna4_comm_build.XXXXXX.log)"
  echo "install: building rdna4_comm in $ROOT (MAX_JOBS=$MAX_JOBS, torch $(python3 -c 'import torch; print(torch.__version__)'));" \
       "1-2 minutes on two cores, the steps as they finish; full log: $log"
  # --use-pep517: without it, older pip (23.x, as here) takes the legacy
  # "setup.py develop" route whenever the `wheel` package is installed, and
  # setuptools' develop shim then rebuilds in an isolated environment that
  # has no torch. NINJA_STATUS: the finished steps and the total.
  if ! NINJA_STATUS="[%f/%t] " pip_install -v --no-build-isolation --use-pep517 -e . 2>&1 | tee "$log" | progress; then
    tail -n 60 "$log"
    echo "install: the build failed; full log: $log" >&2
    exit 1
  fi
fi
python3 -c "import rdna4_comm as rc; print(f'install: rdna4_comm {rc.__version__} from {rc.__file__} (GPU support: {rc._C.with_gpu})')"
