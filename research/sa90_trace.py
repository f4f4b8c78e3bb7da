#!/usr/bin/env python3
"""Read the Hopper attention forward's clock trace (fwd_sm90.cu, SA90_TRACE=1).

    DSV4_EXTRA_DEFINES=SA90_TRACE=1 dsv4 bench sparse-attention --fwd-only --s 4096 --trace-out t
    python3 research/sa90_trace.py t.s4096.h64.d512.bin

Prints, over the traced rows (every 8th) that ran the full number of iterations, the
median (p10, p90) SM-clock time of each event from the producer's entry, the per-iteration
period of each consumer and the time spent in each wait. Slots: fwd_sm90.cu, "Trace slots".
Since v17 a CTA takes many rows and a row's producer starts while the consumers still
finish the CTA's previous row: "entry" is the producer's row start, and a row's "CTA
duration" includes that overlap.
"""
import re
import statistics
import struct
import sys

MASK = (1 << 30) - 1


def load(path):
    h = int(re.search(r"\.h(\d+)\.", path).group(1))
    raw = open(path, "rb").read()
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    rows = len(words) // h
    ctas = []
    for r in range(0, rows - 7, 8):
        w = words[r * h:(r + 8) * h]
        ctas.append(w)
    return ctas


def rel(w, slot):
    """Clock of `slot` relative to the producer's entry (slot 1), cycles."""
    return (w[slot] - w[1]) & MASK


def q(vals):
    vals = sorted(vals)
    if not vals:
        return "-"
    n = len(vals)
    return f"{statistics.median(vals):8.0f} ({vals[n // 10]:.0f}, {vals[(9 * n) // 10]:.0f})"


def main():
    ctas = load(sys.argv[1])
    iters = [w[10] for w in ctas]
    full = max(set(iters), key=iters.count)
    sel = [w for w in ctas if w[10] == full]
    print(f"{len(ctas)} traced CTAs, {len(sel)} with the most common n_iters = {full}")
    ghz = [((w[8] - w[1]) & MASK) / (((w[13] - w[12]) & MASK) or 1) for w in sel]
    print(f"SM clock (cycles / ns, entry -> consumer 0's store): {statistics.median(ghz):.3f} GHz")
    names = {2: "Q copies issued", 3: "slot keys ready", 4: "c0 Q ready", 5: "c1 Q ready",
             6: "c0 loop done", 7: "c1 loop done", 8: "c0 output stored", 9: "c1 output stored",
             11: "producer done"}
    print("\nevent (cycles from the producer's entry): median (p10, p90)")
    for s, n in names.items():
        print(f"  {n:22s} {q([rel(w, s) for w in sel])}")
    # (Since v17 consumer 1 issues its S over half 1 (R) first and its own P1 V1_R before
    # the P hand-off; "buffer 0 half freed" is consumer 0's P0 V0_L done (buffer 0 L) and
    # consumer 1's P0 V0_R done (buffer 0 R).)
    ev = ["S h0 wait start", "S h0 ready", "S h1 wait start", "S h1 ready", "S done", "keys ready",
          "max published", "own PV issued", "buffer 0 half freed", "P hand-off done", "other PV issued", "iter done"]
    for c in (0, 1):
        print(f"\nconsumer {c}:")
        for it in range(min(full, 16)):
            base = 128 + 192 * c + 12 * it
            cells = []
            for e, n in enumerate(ev):
                vals = [rel(w, base + e) for w in sel]
                cells.append(f"{n}={statistics.median(vals):.0f}")
            print(f"  it {it}: " + ", ".join(cells))
        periods = [[(rel(w, 128 + 192 * c + 12 * (it + 1) + 4) - rel(w, 128 + 192 * c + 12 * it + 4)) for w in sel] for it in range(min(full, 16) - 1)]
        print("  period (S done -> next S done): " + ", ".join(q(p).split()[0] for p in periods))
        for hh in (0, 1):
            waits = [[(rel(w, 128 + 192 * c + 12 * it + 2 * hh + 1) - rel(w, 128 + 192 * c + 12 * it + 2 * hh)) for w in sel] for it in range(min(full, 16))]
            print(f"  S half {hh} ready wait by iteration: " + ", ".join(q(x).split()[0] for x in waits))
    print("\nproducer: free wait done / copies issued by iteration, step (0: buffer 0 L, 1: 1 R, 2: 0 R, 3: 1 L, the refill order since v17)")
    for it in range(min(full, 14)):
        cells = []
        for st in range(4):
            a = statistics.median([rel(w, 16 + 8 * it + 2 * st) for w in sel])
            b = statistics.median([rel(w, 16 + 8 * it + 2 * st + 1) for w in sel])
            cells.append(f"{a:.0f}/{b:.0f}")
        print(f"  it {it}: " + "  ".join(cells))
    dur = [max(rel(w, 8), rel(w, 9)) for w in sel]
    print(f"\nCTA duration (entry -> last store): {q(dur)} cycles")


if __name__ == "__main__":
    main()
