"""Each report figure drawn several times in one warm process (Matplotlib imported, fonts loaded, as in
the flow's figure processes), on the test suite's fake report data with 20 000 latent points: a table
of median and minimum milliseconds per figure, and the slowest of those drawn once the scores are known
(the report of a warm GPU run waits for it).

    python bench/figure_times.py [REPEATS]        (default 7; results: bench/results/report.md)
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]

from common import Table, print_header, timeit  # noqa: E402


def main() -> int:
    import beatflow.report.figures as R
    from test_report import _fake_data

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    print_header()
    R.warm_up()
    d = _fake_data(m=20_000, ncols=4000)  # (the flow's columns: beatflow.pipeline.flow.N_COLUMNS)
    table = Table(["figure", "median ms", "min ms"], "lrr")
    table.header()
    medians = {}
    for name, draw in R.FIGURES.items():
        took = timeit(draw, d, repeats=repeats, warmup=0)
        medians[name] = took.median * 1e3
        table.row(name, f"{medians[name]:.1f}", f"{took.min * 1e3:.1f}")
    # the figures drawn at once when the scores are known, each in its own process: the report waits for the
    # slowest (beatflow.pipeline.flow: LATE_FIGURES and the top anomalies' parts)
    late = [n for n in medians if n not in R.EARLY_FIGURES]
    slowest = max(late, key=medians.get)
    print(f"slowest of the late figures ({', '.join(late)}): {slowest}, {medians[slowest]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
