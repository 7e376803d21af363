#!/usr/bin/env bash
# Installs what the tests need (scripts/install.sh test), builds rdna4_comm in
# place and runs the test suite. Extra arguments go to pytest:
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -x -k allreduce # stop at the first failure, a subset
#
# Works from any directory. GPU tests run where GPUs are found and are
# skipped elsewhere; RDNA4_COMM_TEST_TRANSPORTS=cpu,dist,gpu (any subset) selects transports,
# RDNA4_COMM_TEST_JOBS=N the pytest-xdist workers (default 2).
set -euo pipefail

ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/install.sh test
# The test files in RDNA4_COMM_TEST_JOBS pytest-xdist workers (default 2,
# CI's cores; 1 runs them in this process): most tests wait on their ranks'
# processes as much as they compute. Files go out in the order that
# tests/conftest.py gives them (the longest first), which pytest-xdist would
# otherwise replace with most tests first.
workers="${RDNA4_COMM_TEST_JOBS:-2}"
jobs=()
if [ "$workers" -gt 1 ]; then jobs=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
exec python3 -m pytest tests -q -p no:warnings ${jobs[@]+"${jobs[@]}"} "$@"
