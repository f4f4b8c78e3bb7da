#!/usr/bin/env python3
"""Rounds model of the attention backward's CTAs (docs/perf/LOG.md v23).

One CTA a query row, one CTA an SM (132 on the H200), CTAs started in launch order on the
first free SM (greedy list scheduling). A row's cost is its valid slots (a 128-key causal
window plus min(512, (s + 1) / 4) pooled keys, as the bench's selection) plus a fixed cost
`c0` (Q / dO loads, delta, the dq store), in units of a full row. The deterministic
backward runs waves of rows one after the other (each a launch: the next starts when the
last CTA of this one ends), so a wave's last round of a few CTAs leaves the other SMs idle.

Prints the modelled time (in full-row times) of each wave layout: waves of `W` rows in B*S
order or from the last row (`desc`), the remainder wave last in launch order or first.

    python3 research/sa_rounds_model.py
"""
import heapq

SMS = 132


def valid(s):
    return min(s + 1, 128) + min(512, (s + 1) // 4)


def makespan(costs):
    free = [0.0] * SMS
    for c in costs:
        t = heapq.heappop(free)
        heapq.heappush(free, t + c)
    return max(free)


def run(s_len, waves, desc, c0):
    full = 640 + c0
    cost = [(valid(s) + c0) / full for s in range(s_len)]
    total = 0.0
    for a, b in waves:
        rows = range(b - 1, a - 1, -1) if desc else range(a, b)
        total += makespan([cost[i] for i in rows])
    return total


def layout(s_len, w, remainder_first):
    """Waves of w rows over [0, s_len); the short one at the start (remainder_first) or end."""
    if remainder_first:
        r = s_len % w
        out = [(0, r)] if r else []
        out += [(a, a + w) for a in range(r, s_len, w)]
        return out
    return [(a, min(a + w, s_len)) for a in range(0, s_len, w)]


def main():
    c0 = 64
    for s_len, w_fit in ((16384, 3040), (4096, 3160)):
        ideal = sum((valid(s) + c0) / (640 + c0) for s in range(s_len)) / SMS
        print(f"S={s_len}: ideal {ideal:.2f} row times")
        for w in (w_fit, w_fit // SMS * SMS, s_len):
            for desc in (False, True):
                # desc: the waves run from the last rows down, so the remainder wave (launched
                # last) holds the first rows
                waves = layout(s_len, w, remainder_first=desc)
                if desc:
                    waves = waves[::-1]
                print(f"  waves of {w:5d} rows, {'from the last row' if desc else 'B*S order      '}: {run(s_len, waves, desc, c0):7.2f}")


if __name__ == "__main__":
    main()
