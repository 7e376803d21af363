#!/usr/bin/env bash
# run.sh (build head and base, bench rows), then land.sh's sanitizers and
# GPU suite on head with what is left of DEADLINE.
T0=$(date +%s)
OUT=$OUT/ab bash .devrun/run.sh > /tmp/ab.txt 2>&1
tail -12 /tmp/ab.txt
SUITE_S=$(( ${DEADLINE:-560} - 100 - ($(date +%s) - T0) )) OUT=$OUT/land bash .devrun/land.sh
