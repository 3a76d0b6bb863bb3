"""The anomaly table made (``scoring.anomaly_table``) and written (``scoring.write_anomaly_table``) for a
stream's worth of random beats: a table of milliseconds per repeat.

    python bench/table_times.py [ROWS] [REPEATS]        (defaults 97102 and 3: the 20-hour stream's kept beats)
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from beatflow.score.rule import anomaly_table, write_anomaly_table

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 97_102
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rng = np.random.default_rng(0)
    peak = np.sort(rng.integers(0, 72_000_000, n))
    print("| repeat | make ms | write ms |\n|---|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for r in range(1, repeats + 1):
            t = time.perf_counter()
            table = anomaly_table(np.arange(n), np.zeros(n, int), peak, peak - 50, np.full(n, 200),
                                  rng.random(n).astype(np.float32), 360.0, 0.9, ["a"])
            t1 = time.perf_counter()
            write_anomaly_table(table, os.path.join(d, "anomalies.parquet"))
            print(f"| {r} | {(t1 - t) * 1e3:.1f} | {(time.perf_counter() - t1) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
