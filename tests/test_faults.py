"""Faults during a run: a Dask worker killed mid-run, the whole run killed during training."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT, run_cli


def _worker_processes():
    """The Dask worker processes started by this process (spawned children, not the Prefect server)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing" in cmd and "spawn_main" in cmd:
            out.append(p)
    return out


def _kill_one_worker_when(path_glob_parent, name, killed: list, timeout=600):
    """Wait until a file ``name`` appears in a ``*.partial`` folder of the run, then SIGKILL one worker."""
    t_end = time.time() + timeout
    while time.time() < t_end:
        if any((d / name).exists() for d in path_glob_parent.glob(".*.partial")):
            workers = _worker_processes()
            if workers:
                victim = workers[0]
                killed.append(victim.pid)
                victim.kill()
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _run(out, **kw):
    from beatflow.pipeline.flow import ecg_anomaly_flow
    from beatflow.pipeline.cluster import make_task_runner

    runner = make_task_runner("cpu", 2)
    return ecg_anomaly_flow.with_options(task_runner=runner)(out=str(out), device="cpu", workers=2, **kw)


def test_worker_killed_mid_run_gives_the_same_result(harness, tmp_path):
    """A worker dies after training, while its partitions are still needed for scoring: Dask recomputes
    what it held (load → segment → embed of its partitions) and the run ends with the same beats and scores."""
    params = dict(hours=0.2, seed=11, epochs=2, partitions=4)
    clean = _run(tmp_path / "clean", **params)
    killed: list = []
    killer = threading.Thread(target=_kill_one_worker_when, args=(tmp_path, "model.pt", killed), daemon=True)
    killer.start()
    faulted = _run(tmp_path / "faulted", **params)
    killer.join(timeout=5)
    assert killed, "no worker was killed (the run ended before training finished?)"
    for key in ("beats_detected", "beats_kept", "anomalies_flagged", "train_loss", "test_loss"):
        assert faulted[key] == clean[key], key
    a = pd.read_parquet(tmp_path / "clean" / "anomalies.parquet")
    b = pd.read_parquet(tmp_path / "faulted" / "anomalies.parquet")
    assert len(a) == len(b) > 0
    np.testing.assert_array_equal(a["start"].to_numpy(), b["start"].to_numpy())
    np.testing.assert_allclose(a["score"].to_numpy(), b["score"].to_numpy(), rtol=1e-5)


def test_run_killed_during_training_resumes_after_the_last_finished_task(prefect_server, tmp_path):
    """SIGKILL of the whole run (CLI process and its workers) in the middle of training; the same
    command again reuses the persisted segmentation and trains from the start; no output of the
    killed run is left at the output path."""
    from beatflow.io.synth import synthesize_ecg

    x = synthesize_ecg(hours=0.1, fs=250.0, seed=9).signal
    p = tmp_path / "in.csv"
    p.write_text("ecg\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")
    cache = tmp_path / "cache"
    args = ["run", "--input", p, "--epochs", "300", "--device", "cpu", "--workers", "2", "--cache", cache,
            "--out", tmp_path / "out", "--verbose"]  # (the flow's log on the terminal, read below)
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "beatflow.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "epoch 3/300" in line:  # training is under way
                break
        else:
            pytest.fail("the run ended before training started:\n" + "".join(seen)[-3000:])
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its Dask workers, no chance to clean up
        proc.wait(timeout=60)
    assert not (tmp_path / "out").exists()  # nothing at the output path
    assert len(list(tmp_path.glob(".out.*.partial"))) == 1  # the killed run's work folder

    again = run_cli(args, prefect_server)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    cached = [ln for ln in log.splitlines() if "Finished in state Cached" in ln]
    assert [ln for ln in cached if "Task run 'segment-" in ln]  # segmentation (all partitions): reused
    assert not [ln for ln in cached if "train-vae" in ln]  # training had not finished: run again
    assert not list(tmp_path.glob(".out.*.partial"))  # removed by the next run (its owner is dead)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert len(summary["train_loss"]) == 300 and summary["beats_detected"] > 300


def test_only_partials_of_dead_runs_on_this_host_are_removed(tmp_path):
    import socket

    from beatflow.pipeline.outputs import OWNER, remove_stale_partials

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    cases = {"dead": f"{host} {dead.pid}", "alive": f"{host} {os.getppid()}",
             "other-host": f"elsewhere {dead.pid}", "no-owner": None, "garbled": "x"}
    for name, owner in cases.items():
        d = tmp_path / f".run.{name}.partial"
        d.mkdir()
        if owner is not None:
            (d / OWNER).write_text(owner)
    (tmp_path / ".other.dead.partial").mkdir()  # another output name: not ours to touch
    removed = remove_stale_partials(tmp_path / "run")
    assert [p.name for p in removed] == [".run.dead.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".run.{n}.partial" for n in cases if n != "dead"] + [".other.dead.partial"])
