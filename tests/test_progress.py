"""The status line of a long run: each stage's partitions done out of all, and the time left."""
from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

from beatflow import terminal
from beatflow.terminal import Progress


class _Status:
    def __init__(self):
        self.lines = []

    def update(self, text):
        self.lines.append(text)


def test_progress_counts_and_estimates_the_time_left(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(terminal.time, "monotonic", lambda: clock[0])
    status = _Status()
    log = terminal.RunLog("x")
    log._status = (status, None, ())
    monkeypatch.setattr(terminal, "_CURRENT", log)
    p = Progress("segment-partition", 4)
    clock[0] = 102.0
    p.done()  # 1 of 4 in 2 s: 6 s left
    clock[0] = 104.0
    p.done()  # 2 of 4 in 4 s: 4 s left
    clock[0] = 400.0
    p.done()  # 3 of 4 in 300 s: 100 s left, in minutes
    p.done()
    assert status.lines == ["beatflow: segment-partition: 1/4 partitions, ETA 6 s",
                            "beatflow: segment-partition: 2/4 partitions, ETA 4 s",
                            "beatflow: segment-partition: 3/4 partitions, ETA 1.7 min",
                            "beatflow: segment-partition: 4/4 partitions"]


def test_without_a_status_line_progress_only_counts(monkeypatch):
    monkeypatch.setattr(terminal, "_CURRENT", None)
    p = Progress("load-partition", 2)
    p.done()
    assert p.n == 1 and p.text().startswith("load-partition: 1/2 partitions, ETA")


def test_a_run_on_a_terminal_shows_its_partitions(tmp_path):
    """``beatflow run`` on a pseudo-terminal: the status line names the stages' partitions as they finish."""
    master, slave = os.openpty()
    env = {**os.environ, "BEATFLOW_NO_SERVICE": "1", "COLUMNS": "150", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "beatflow.cli", "run", "--hours", "0.5", "--epochs", "1",
                             "--partitions", "6", "--out", str(tmp_path / "out")],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < 300:
        r, _, _ = select.select([master], [], [], 1.0)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the command exited and closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=60) == 0, out[-2000:]
    text = out.decode("utf-8", "replace")
    seen = set(re.findall(r"beatflow: ([a-z-]+): (\d+)/6 partitions", text))
    # (the line is redrawn a few times a second: a stage that ends between two redraws may not show)
    assert len({stage for stage, _ in seen}) >= 3 and any(n == "6" for _, n in seen), sorted(seen)
    assert re.search(r"/6 partitions, ETA \d", text)
    assert (tmp_path / "out" / "summary.json").is_file()
