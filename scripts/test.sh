#!/usr/bin/env bash
# Installs what the tests need (scripts/install.sh test), builds rdna4_comm in
# place and runs the test suite. Extra arguments go to pytest:
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -x -k allreduce # stop at the first failure, a subset
#
# Works from any directory. GPU tests run where GPUs are found and are
# skipped elsewhere; RDNA4_COMM_TEST_TRANSPORTS=cpu,dist,gpu (any subset) selects transports.
set -euo pipefail

ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/install.sh test
exec python3 -m pytest tests -q -p no:warnings "$@"
