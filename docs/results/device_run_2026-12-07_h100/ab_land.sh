#!/usr/bin/env bash
# run.sh (build head = working tree and base = .before/base, bench ROWS on
# both), then land.sh (sanitizers, whole GPU suite) on LAND_TREE (base or
# head) with what is left of DEADLINE.
T0=$(date +%s); ROOT=$PWD
TREES=base BENCHES="head:1 base:1" SAN_BEFORE=0 NCU_TREES="" OUT=$OUT/ab bash .devrun/run.sh > /tmp/ab.txt 2>&1
tail -12 /tmp/ab.txt
[ "${LAND_TREE:-base}" = base ] && cd .before/base
SUITE_S=$(( ${DEADLINE:-560} - 150 - ($(date +%s) - T0) )) OUT=$OUT/land bash $ROOT/.devrun/land.sh
