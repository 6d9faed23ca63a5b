"""Print the low-bit decode kernel (dispatch name) that was fastest in an attention-bench.json:
the smallest geometric mean over rows and widths of its time relative to the best implementation."""

from __future__ import annotations

import json
import math
import sys


def pick(result: dict) -> str:
    scores: dict[str, list[float]] = {}
    for row in result["rows"]:
        for bits in (4, 3, 2):
            times = row.get(f"int{bits}_impl_ms", {})
            if not times:
                continue
            fastest = min(times.values())
            for name, ms in times.items():
                scores.setdefault(name, []).append(math.log(ms / fastest))
    complete = {n: v for n, v in scores.items() if len(v) == max(len(x) for x in scores.values())}
    return min(complete, key=lambda n: sum(complete[n]) / len(complete[n]))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(pick(json.load(f)))
