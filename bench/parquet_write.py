"""The anomaly table's Parquet file: Parquet's default encoding against ``write_anomaly_table`` (dictionary
encoding for the recording names only), on a table of the 20 h default run's size (97 102 beats, one
recording): a table of the best of ``REPEATS`` writes each, in milliseconds, and the file sizes.

    python bench/parquet_write.py [REPEATS]        (default 7)
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import numpy as np

    from beatflow.score.rule import anomaly_table, write_anomaly_table

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    n = 97_102
    rng = np.random.default_rng(0)
    peak = np.sort(rng.choice(18_000_000, size=n, replace=False))
    table = anomaly_table(np.arange(n), np.zeros(n, int), peak, peak - 50, rng.integers(100, 300, n),
                          rng.random(n).astype(np.float32), 250.0, 0.9, ["input"])
    ways = {"default (every column dictionary-encoded)": lambda path: table.to_parquet(path, index=False),
            "write_anomaly_table (names only)": lambda path: write_anomaly_table(table, path)}
    print("| writing | best ms | file kB |\n|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in ways.items():
            path = os.path.join(tmp, "t.parquet")
            write(path)  # (pyarrow's first call)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                write(path)
                best = min(best, time.perf_counter() - t)
            print(f"| {name} | {best * 1e3:.1f} | {os.path.getsize(path) / 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
