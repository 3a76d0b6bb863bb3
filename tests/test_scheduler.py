"""`beatflow run --scheduler tcp://...` on a Dask cluster started as separate processes (a scheduler
and two workers, as on several nodes) gives the same beats and scores as the local cluster."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from conftest import ROOT, _free_port, run_cli


def test_existing_cluster_matches_local(prefect_server, tmp_path):
    dask = str(Path(sys.executable).with_name("dask"))
    port = _free_port()
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": str(ROOT),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    time.sleep(3)
    for _ in range(2):
        procs.append(subprocess.Popen([dask, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1",
                                       "--no-dashboard", "--host", "127.0.0.1"], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
        common = ["run", "--hours", "0.1", "--seed", "3", "--epochs", "2", "--device", "cpu", "--partitions", "3"]
        remote = run_cli([*common, "--scheduler", f"tcp://127.0.0.1:{port}", "--workers", "2",
                          "--out", tmp_path / "remote"], prefect_server)
        assert remote.returncode == 0, remote.stderr[-2000:]
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)
    local = run_cli([*common, "--workers", "2", "--out", tmp_path / "local"], prefect_server)
    assert local.returncode == 0, local.stderr[-2000:]
    a, b = (pd.read_parquet(tmp_path / d / "anomalies.parquet") for d in ("remote", "local"))
    np.testing.assert_array_equal(a["peak"], b["peak"])
    np.testing.assert_allclose(a["score"], b["score"], rtol=1e-4, atol=1e-6)
    assert a["flagged"].tolist() == b["flagged"].tolist()
