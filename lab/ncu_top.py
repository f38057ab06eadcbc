"""Summarise an ncu source page (``ncu -i R --page source --csv --print-source sass``): the SASS lines with the
most warp-stall samples and their leading stall reasons. ``python lab/ncu_top.py FILE.csv [N]``."""

import csv
import sys


def main():
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = list(csv.reader(open(path, newline="")))
    hdr_i = next(i for i, r in enumerate(rows) if any(c.strip().startswith("Source") for c in r))
    hdr = [c.strip() for c in rows[hdr_i]]
    body = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]
    print("columns:", "; ".join(hdr)[:2000])
    src = next(i for i, c in enumerate(hdr) if c.startswith("Source"))
    allc = next((i for i, c in enumerate(hdr) if "Sampling (All" in c), None)
    stall_cols = [i for i, c in enumerate(hdr) if c.lower().startswith("stall_") or "stall" in c.lower() and i != allc
                  and "Sampling" not in c]

    def num(v):
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return 0.0
    if allc is None:
        print("no sampling column")
        return
    tot = sum(num(r[allc]) for r in body)
    print(f"lines {len(body)}, samples {tot:.0f}")
    # totals per stall reason
    if stall_cols:
        sums = sorted(((sum(num(r[i]) for r in body), hdr[i]) for i in stall_cols), reverse=True)
        print("by reason:", ", ".join(f"{h} {v / max(tot, 1):.1%}" for v, h in sums[:12]))
    top = sorted(range(len(body)), key=lambda i: -num(body[i][allc]))[:n]
    for i in sorted(top):
        r = body[i]
        reasons = sorted(((num(r[c]), hdr[c]) for c in stall_cols), reverse=True)[:3]
        print(f"{i:5d} {num(r[allc]) / max(tot, 1):6.2%}  {r[src].strip()[:70]:70s}  " +
              ", ".join(f"{h.replace('stall_', '')[:24]} {v:.0f}" for v, h in reasons if v))


if __name__ == "__main__":
    main()
