#!/usr/bin/env bash
# Installs rdna4_comm with what the demo needs (scripts/install.sh demo: torch
# and the build tools) and runs the demo:
# dispatch -> experts -> combine and all_reduce on whatever this machine has
# (GPUs, or CPU processes over shared memory), checked against the reference,
# with a latency table. Extra arguments go to the demo (--help lists them).
#
#   bash scripts/demo.sh
set -euo pipefail

ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/install.sh demo
exec python3 -m rdna4_comm.demo "$@"
