"""Cluster plumbing: RMM pool sizes as dask-cuda reads them, and a cluster without workers."""
import pytest

from beatflow.errors import DeviceError, InputError
from tasks.cluster import parse_pool_size, wait_for_workers


@pytest.mark.parametrize("value, want", [("80%", 0.8), (0.8, 0.8), ("0.5", 0.5), ("100%", 1.0), ("40GB", "40GB"),
                                         (2e9, 2_000_000_000), ("3000000000", 3_000_000_000)])
def test_pool_size_in_dask_cuda_terms(value, want):
    got = parse_pool_size(value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value", ["lots", "-5%", "150%", 0, -1.0, "0GB"])
def test_bad_pool_size_is_an_input_error(value):
    with pytest.raises(InputError, match="rmm-pool-size"):
        parse_pool_size(value)


def test_cluster_without_workers_is_an_error_not_a_hang():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster):
        with pytest.raises(DeviceError, match="0 of 1 workers after 2 s"):
            wait_for_workers(1, timeout=2)


def _trim_setting():
    import os

    return os.environ.get("MALLOC_TRIM_THRESHOLD_")


def test_workers_start_without_eager_malloc_trimming(monkeypatch):
    """distributed spawns workers with MALLOC_TRIM_THRESHOLD_=65536 (and writes it into the parent's own
    environment); PyTorch training in such a worker ran 3x slower, so the flow's workers must not get it,
    even when this process inherited it."""
    import os

    from distributed import Client, LocalCluster

    from tasks.cluster import _configure_worker_spawn

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")  # as left by an earlier cluster in this process
    _configure_worker_spawn()
    assert "MALLOC_TRIM_THRESHOLD_" not in os.environ
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        assert list(client.run(_trim_setting).values()) == [None]


def test_transfer_counters_are_per_run_on_long_lived_workers():
    """A worker of an existing cluster serves run after run: each run reports its own device-to-host bytes."""
    from beatflow import backend as bk

    total = bk._D2H_BYTES[0]
    bk.begin_run("run-a")
    bk._D2H_BYTES[0] += 100  # what to_host adds for a 100-byte device array
    bk.begin_run("run-a")  # another partition of the same run on this worker: no reset
    bk._D2H_BYTES[0] += 20
    assert bk.transfer_stats("run-a")["d2h_bytes"] == 120
    bk.begin_run("run-b")
    bk._D2H_BYTES[0] += 7
    assert bk.transfer_stats("run-b")["d2h_bytes"] == 7
    assert bk.transfer_stats("run-a")["d2h_bytes"] == total + 127  # not this worker's current run: all bytes
    assert bk.transfer_stats()["d2h_bytes"] == total + 127


def test_unknown_rmm_allocator_is_an_input_error():
    from tasks.cluster import make_task_runner

    with pytest.raises(InputError, match="--rmm-allocator: 'arena' is not one of async, pool"):
        make_task_runner("gpu", 1, rmm_allocator="arena")


@pytest.mark.parametrize("value, want", [("40GB", 40_000_000_000), ("3000000000", 3_000_000_000), ("", None)])
def test_reported_pool_size(monkeypatch, value, want):
    from beatflow.backend import _rmm_setup_pool_size

    monkeypatch.setenv("BEATFLOW_RMM_POOL_SIZE", value)
    assert _rmm_setup_pool_size() == want


def test_a_gpu_listed_twice_is_an_input_error():
    from tasks.cluster import make_task_runner

    with pytest.raises(InputError, match="--gpus 0,0: a GPU is listed twice"):
        make_task_runner("gpu", 2, gpus="0,0")


def test_gpu_workers_get_their_environment_as_pre_spawn_variables():
    # dask-cuda replaces a worker's `env` with CUDA_VISIBLE_DEVICES: Numba's RMM manager and the pool
    # size must reach the worker processes another way
    import dask

    from tasks.cluster import gpu_worker_env

    with dask.config.set({"distributed.nanny.pre-spawn-environ": {"KEEP": "1"}}):
        got = gpu_worker_env({"OMP_NUM_THREADS": "1"}, 0.8)
        env = dask.config.get("distributed.nanny.pre-spawn-environ")
    assert env["NUMBA_CUDA_MEMORY_MANAGER"] == "rmm.allocators.numba" == got["NUMBA_CUDA_MEMORY_MANAGER"]
    assert env["BEATFLOW_RMM_POOL_SIZE"] == "0.8" and env["OMP_NUM_THREADS"] == "1" and env["KEEP"] == "1"


def test_gpu_cluster_settings(monkeypatch):
    # what the flow asks of dask-cuda (a stand-in module here: CI has no dask-cuda): one worker per GPU
    # with one thread (what it prepares per thread, it prepares once), RMM's async pool shared with
    # CuPy and PyTorch
    import sys
    import types

    import dask

    from tasks.cluster import GPU_WORKER_THREADS, make_task_runner

    fake = types.ModuleType("dask_cuda")
    fake.LocalCUDACluster = type("LocalCUDACluster", (), {})
    monkeypatch.setitem(sys.modules, "dask_cuda", fake)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {}}):
        runner = make_task_runner("gpu", 1, rmm_pool_size="50%", gpus="0,1")
    kw = runner.cluster_kwargs
    assert runner.cluster_class in ("dask_cuda.LocalCUDACluster", fake.LocalCUDACluster)
    assert GPU_WORKER_THREADS == 1 and kw["threads_per_worker"] == 1
    assert kw["rmm_pool_size"] == 0.5 and kw["rmm_async"] is True and kw["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert kw["rmm_allocator_external_lib_list"] == ["cupy", "torch"]
