"""Where the wall time of a ``beatflow run`` command goes, outside the flow's own stages.

A standing Prefect server and CPU cluster (as ``bench/gpu_flow_persistent.py``), then ``RUNS`` times
``python -m beatflow.cli run --scheduler ...`` for each tree of ``TREES`` in turn (interleaved, so
that both see the same machine), the command's own process importing that tree's code (the workers
keep this tree's). From the process's start and end and its log's timestamps:

* ``start``: from the process's start to Prefect's "Beginning flow run" (imports, the figure
  processes, the task runner);
* ``flow``: from there to the flow's "outputs in" (``summary.json``'s total is this, less Prefect's
  flow-run set-up);
* ``to completed``: from "outputs in" to "Finished in state Completed()" (Prefect's engine after the
  flow function has returned);
* ``exit``: from there to the process's end (the task runner's client, the interpreter's exit).

Run from the repository root::

    TREES="/tmp/base $PWD" RUNS=5 HOURS=2 python bench/cli_wall.py      (results: bench/results/cli.md)

``CLUSTER=own``: each command starts and closes a cluster of its own (``beatflow run`` without
``--scheduler``, the README's command; the Prefect server still stands), whose closing falls in
``to completed``.

The first run of each tree is one of a fresh cluster's first runs (workers cold) and is left out of
the medians.

``CLUSTER=service``: ``beatflow run`` as a user types it (no ``--scheduler``, no ``PREFECT_API_URL``), with
``beatflow serve`` up and with ``--no-service`` (its own Prefect server and cluster), interleaved, ``RUNS``
times each, in this tree; the command's defaults (20 h, 10 epochs) unless ``HOURS`` / ``EPOCHS`` are set.
The service (``beatflow serve --detach --device cpu --workers WORKERS``, in a data folder of its own) gets
one short run first (``WARMUP_HOURS``, 1 epoch; ``WARMUP_HOURS=0``: none), as a workstation's service has
had; every measured run counts (no run is left out)::

    CLUSTER=service RUNS=1 python bench/cli_wall.py
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from common import print_header, print_table  # noqa: E402


def _clock(line: str) -> float | None:
    """Seconds since midnight of a Prefect log line's ``HH:MM:SS.mmm`` stamp."""
    try:
        h, m, s = line[:12].split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)
    except ValueError:
        return None


def _phases(t0: float, t1: float, lines: list[str]) -> dict:
    day = datetime.fromtimestamp(t0)
    base = day.hour * 3600 + day.minute * 60 + day.second + day.microsecond / 1e6

    def at(text: str) -> float:
        hits = [_clock(line) for line in lines if text in line]
        hits = [h for h in hits if h is not None]
        if not hits:
            raise RuntimeError(f"no log line with {text!r}")
        return hits[-1] - base

    begin, outputs = at("Beginning flow run"), at("outputs in")
    done = at("Finished in state Completed()")
    return {"wall": t1 - t0, "start": begin, "flow": outputs - begin, "to completed": done - outputs,
            "exit": (t1 - t0) - done}


def _service_main() -> int:
    """``CLUSTER=service``: ``beatflow run`` with ``beatflow serve`` up and with ``--no-service``."""
    import json
    import tempfile

    runs, workers = int(os.environ.get("RUNS", "1")), os.environ.get("WORKERS", "2")
    hours, epochs = os.environ.get("HOURS"), os.environ.get("EPOCHS")
    warmup = float(os.environ.get("WARMUP_HOURS", "0.1"))
    print_header()
    tmp = tempfile.mkdtemp(prefix="bf-cli-service-")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "BEATFLOW_NO_SERVICE")}
    env.update({"BEATFLOW_DATA_DIR": os.path.join(tmp, "data"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])})
    cli = [sys.executable, "-m", "beatflow.cli"]

    def command(args: list[str], n: int) -> tuple[float, float, subprocess.CompletedProcess, str]:
        logs = os.path.join(tmp, f"logs-{n}")
        t0 = time.time()
        p = subprocess.run(cli + args, env={**env, "BEATFLOW_LOG_DIR": logs}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        t1 = time.time()
        if p.returncode:
            print(p.stdout[-3000:])
            raise SystemExit(f"{' '.join(args)}: rc {p.returncode}")
        found = sorted(os.listdir(logs)) if os.path.isdir(logs) else []
        text = open(os.path.join(logs, found[-1])).read() if found else ""
        return t0, t1, p, text

    t0, t1, _, _ = command(["serve", "--detach", "--device", "cpu", "--workers", workers], 0)
    print(f"beatflow serve --detach: {t1 - t0:.2f} s to ready", flush=True)
    rows: dict[str, list[dict]] = {"service": [], "own (--no-service)": []}
    n = 1
    try:
        if warmup:
            out = os.path.join(tmp, "warmup")
            command(["run", "--hours", str(warmup), "--epochs", "1", "--device", "cpu", "--out", out], n)
            n += 1
        for r in range(runs):
            for mode in rows:
                out = os.path.join(tmp, f"run-{n}")
                args = ["run", "--device", "cpu", "--workers", workers, "--out", out]
                args += (["--hours", hours] if hours else []) + (["--epochs", epochs] if epochs else [])
                args += [] if mode == "service" else ["--no-service"]
                t0, t1, p, text = command(args, n)
                n += 1
                summary = json.load(open(os.path.join(out, "summary.json")))
                shutil.rmtree(out, ignore_errors=True)
                assert summary["service"] is (mode == "service"), summary["service"]
                ph = {**_phases(t0, t1, text.splitlines()), "summary total": summary["timings_s"]["total"]}
                rows[mode].append(ph)
                print(f"{mode} run {r}: " + "  ".join(f"{k} {v:.2f}" for k, v in ph.items()), flush=True)
    finally:
        subprocess.run(cli + ["serve", "--stop"], env=env)
        shutil.rmtree(tmp, ignore_errors=True)
    keys = ["wall", "start", "flow", "to completed", "exit", "summary total"]
    print(f"\nmedians of {runs} run(s) each (s), {hours or '20 (default)'} h synthetic ECG, "
          f"{epochs or '10 (default)'} epochs, CPU, {workers} workers")
    print_table(["cluster"] + keys, [[mode] + [f"{statistics.median(p[k] for p in rows[mode]):.2f}" for k in keys]
                                     for mode in rows])
    return 0


def main() -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("CLUSTER") == "service":
        return _service_main()
    from distributed import LocalCluster
    from prefect.server.api.server import SubprocessASGIServer

    from beatflow.pipeline.cluster import _configure_worker_spawn

    trees = (os.environ.get("TREES") or ROOT).split()
    runs, hours = int(os.environ.get("RUNS", "4")), os.environ.get("HOURS", "2")
    workers = int(os.environ.get("WORKERS", "2"))
    own = os.environ.get("CLUSTER", "standing") == "own"
    print_header()
    server = SubprocessASGIServer()
    server.start(timeout=120)
    env = {"PREFECT_API_URL": server.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT}
    _configure_worker_spawn()  # as the flow's own CPU cluster
    cluster = None if own else LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                            host="127.0.0.1", dashboard_address="127.0.0.1:0", env=env)
    rows: dict[str, list[dict]] = {t: [] for t in trees}
    try:
        for r in range(runs):
            for tree in trees:
                out = f"/tmp/bf-cli-wall-{r}"
                shutil.rmtree(out, ignore_errors=True)
                cmd = [sys.executable, "-m", "beatflow.cli", "run", "--hours", hours, "--epochs", "1", "--device", "cpu",
                       "--workers", str(workers), "--out", out]
                cmd += [] if own else ["--scheduler", cluster.scheduler_address]
                t0 = time.time()
                p = subprocess.run(cmd, env={**os.environ, **env, "PYTHONPATH": tree}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, cwd=tree)
                t1 = time.time()
                shutil.rmtree(out, ignore_errors=True)
                if p.returncode:
                    print(p.stdout[-3000:])
                    raise SystemExit(f"{tree}: run {r} failed (rc {p.returncode})")
                ph = _phases(t0, t1, p.stdout.splitlines())
                rows[tree].append(ph)
                print(f"{tree} run {r}: " + "  ".join(f"{k} {v:.2f}" for k, v in ph.items()), flush=True)
    finally:
        if cluster is not None:
            cluster.close()
        server.stop()
    keys = ["wall", "start", "flow", "to completed", "exit"]
    print(f"\nmedians of runs 2-{runs} (s), {hours} h synthetic ECG, 1 epoch, "
          f"{'its own' if own else 'a standing'} CPU cluster of {workers} workers")
    print_table(["tree"] + keys, [[tree] + [f"{statistics.median(p[k] for p in (rows[tree][1:] or rows[tree])):.2f}"
                                          for k in keys] for tree in trees])
    return 0


if __name__ == "__main__":
    sys.exit(main())
