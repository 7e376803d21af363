"""chunk_slots.patch's pair rule, step by step as its ChunkSlots threads run
it, against the rule of docs/semantics.md ("Expert layout") that row_pairs
implements: a row's pairs by ascending local expert, each pair's weight its
slots' weights summed in fp32 in slot order from the first, ids outside
[0, E) starting none. Random rows of K in {1, 2, 6, 8, 33, 64} slots with
repeated, negative and out-of-range ids. No GPU: this checks the
arithmetic of the patch's three steps, not the kernel.

    python3 docs/results/prepared_2026-12-07_chunk_slots/pair_rule.py
"""
import random

import numpy as np


def rule(ids, weights, experts):
    pairs = {}
    for e, w in zip(ids, weights):
        if 0 <= e < experts:
            pairs[e] = np.float32(w) if e not in pairs else np.float32(pairs[e] + np.float32(w))
    return sorted(pairs.items())


def chunk_slots(ids, weights, experts):
    K = len(ids)
    slot = [e if 0 <= e < experts else -1 for e in ids]  # load
    starts = 0
    for k in range(K):  # find_starts: no earlier slot names the expert
        if slot[k] >= 0 and all(slot[kk] != slot[k] for kk in range(k)):
            starts |= 1 << k
    by_place = {}
    for k in range(K):  # place: the pairs of smaller experts, the weight in slot order
        if not starts >> k & 1:
            continue
        e, w = slot[k], np.float32(weights[k])
        at = sum(1 for kk in range(K) if starts >> kk & 1 and slot[kk] < e)
        for kk in range(k + 1, K):
            if slot[kk] == e:
                w = np.float32(w + np.float32(weights[kk]))
        by_place[at] = (e, w)
    return [by_place[p] for p in range(bin(starts).count("1"))]


def main():
    rng = random.Random(0)
    for _ in range(20000):
        K, E = rng.choice([1, 2, 6, 8, 33, 64]), rng.choice([1, 4, 16, 256])
        ids = [rng.randint(-2, E + 1) for _ in range(K)]
        weights = [np.float32(rng.uniform(-1, 1)) for _ in range(K)]
        want, got = rule(ids, weights, E), chunk_slots(ids, weights, E)
        assert [(e, float(w)) for e, w in want] == [(e, float(w)) for e, w in got], (ids, want, got)
    print("20000 rows: the same pairs, places and weight bits")


if __name__ == "__main__":
    main()
