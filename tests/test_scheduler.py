"""`beatflow run --scheduler tcp://...` on a Dask cluster started as separate processes (a scheduler
and two workers, as on several nodes) gives the same beats and scores as the local cluster; with
`--device gpu` its workers must have the GPUs (checked on them by the GPU memory plugin)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from beatflow.errors import DeviceError
from conftest import ROOT, _free_port, run_cli


@pytest.fixture(scope="module")
def existing_cluster(prefect_server):
    """A `dask scheduler` and two single-threaded `dask worker` processes (CPU), as a user starts them."""
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
        yield f"tcp://127.0.0.1:{port}"
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


_GPU_HERE = bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or __import__("importlib").util.find_spec("cupy") is not None


def test_existing_cluster_matches_local(prefect_server, existing_cluster, tmp_path):
    common = ["run", "--hours", "0.1", "--seed", "3", "--epochs", "2", "--partitions", "3"]
    # no --workers: the flow takes the cluster's two; --device auto: the workers have no GPU, so the CPU
    remote = run_cli([*common, "--device", "cpu" if _GPU_HERE else "auto", "--scheduler", existing_cluster,
                      "--out", tmp_path / "remote"], prefect_server)
    assert remote.returncode == 0, remote.stderr[-2000:]
    summary = json.loads((tmp_path / "remote" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["device"] == "cpu"
    local = run_cli([*common, "--device", "cpu", "--workers", "2", "--out", tmp_path / "local"], prefect_server)
    assert local.returncode == 0, local.stderr[-2000:]
    a, b = (pd.read_parquet(tmp_path / d / "anomalies.parquet") for d in ("remote", "local"))
    np.testing.assert_array_equal(a["peak"], b["peak"])
    np.testing.assert_allclose(a["score"], b["score"], rtol=1e-4, atol=1e-6)
    assert a["flagged"].tolist() == b["flagged"].tolist()


@pytest.mark.skipif(_GPU_HERE, reason="the workers of this cluster would see a GPU")
def test_gpu_run_on_workers_without_a_gpu_names_the_worker(prefect_server, existing_cluster, tmp_path):
    """--device gpu with --scheduler is checked on the workers (this machine's GPUs do not matter):
    a worker without CuPy or a CUDA device stops the run with one line naming it, nothing written."""
    out = tmp_path / "out"
    r = run_cli(["run", "--hours", "0.1", "--epochs", "1", "--device", "gpu", "--scheduler", existing_cluster,
                 "--out", out], prefect_server)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("beatflow: error: --device gpu: a Dask worker cannot run on the GPU: worker tcp://127.0.0.1:"), \
        r.stderr[-2000:]
    assert "no CUDA device, or CuPy is not installed here" in last
    assert not out.exists() and not [q for q in tmp_path.iterdir() if q.name.endswith(".partial")]


@pytest.mark.skipif(_GPU_HERE, reason="the workers of this cluster would see a GPU")
def test_auto_device_on_an_existing_cluster_is_decided_by_its_workers(existing_cluster):
    """--device auto with --scheduler asks the workers (here: CPU workers), not this machine."""
    from beatflow.pipeline.cluster import cluster_device

    assert cluster_device(existing_cluster) == "cpu"
    with pytest.raises(DeviceError, match=r"^--scheduler tcp://127\.0\.0\.1:1: cannot reach the Dask scheduler"):
        cluster_device("tcp://127.0.0.1:1", timeout=2)
