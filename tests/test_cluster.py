"""Cluster plumbing: RMM pool sizes as dask-cuda reads them, and a cluster without workers."""
import pytest

from beatflow.errors import DeviceError, InputError
from beatflow.pipeline.cluster import parse_pool_size, wait_for_workers


@pytest.mark.parametrize("value, want", [("80%", 0.8), (0.8, 0.8), ("0.5", 0.5), ("100%", 1.0), ("40GB", 40_000_000_000),
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


def _preloaded():
    import sys

    return "beatflow.pipeline.worker_preload" in sys.modules


def test_workers_start_without_eager_malloc_trimming(monkeypatch):
    """distributed spawns workers with MALLOC_TRIM_THRESHOLD_=65536 (and writes it into the parent's own
    environment); PyTorch training in such a worker ran 3x slower, so the flow's workers must not get it,
    even when this process inherited it. They preload ``beatflow.pipeline.worker_preload`` (their exit without a
    last full collection: tests/test_cli.py)."""
    import os

    from distributed import Client, LocalCluster

    from beatflow.pipeline.cluster import _configure_worker_spawn, make_task_runner

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")  # as left by an earlier cluster in this process
    _configure_worker_spawn()
    assert "MALLOC_TRIM_THRESHOLD_" not in os.environ
    preload = make_task_runner("cpu", 1).cluster_kwargs["preload"]  # as the flow's own cluster
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      preload=preload) as cluster, Client(cluster) as client:
        assert list(client.run(_trim_setting).values()) == [None]
        assert list(client.run(_preloaded).values()) == [True]


def _mark_at_exit(path):
    import atexit
    import os

    atexit.register(lambda: open(path, "w").write("exited normally"))
    return os.getpid()


@pytest.mark.parametrize("fast", [True, False])
def test_a_closing_worker_ends_its_process_at_once_when_asked(tmp_path, fast):
    """The flow's own workers get BEATFLOW_WORKER_FAST_EXIT: their preload's teardown ends the process where
    the worker's close is done with its nanny and scheduler, so no exit handler runs and the close does not
    wait for the interpreter's (a GPU worker's) slow exit. Without it the worker exits as Dask's do."""
    import psutil
    from distributed import Client, LocalCluster

    from beatflow.pipeline.cluster import worker_env
    from beatflow.pipeline.worker_preload import FAST_EXIT_VAR

    env = worker_env()
    assert env[FAST_EXIT_VAR] == "1"
    if not fast:
        env.pop(FAST_EXIT_VAR)
    mark = tmp_path / "exit-mark"
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None, env=env,
                      preload=["beatflow.pipeline.worker_preload"]) as cluster, Client(cluster) as client:
        pid = list(client.run(_mark_at_exit, str(mark)).values())[0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert mark.exists() is (not fast)


def test_transfer_counters_are_per_run_on_long_lived_workers():
    """A worker of an existing cluster serves run after run: each run reports its own device-to-host bytes."""
    from beatflow import device as bk
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
    from beatflow.pipeline.cluster import make_task_runner

    with pytest.raises(InputError, match="--rmm-allocator: 'arena' is not one of async, pool"):
        make_task_runner("gpu", 1, rmm_allocator="arena")


@pytest.mark.parametrize("value, want", [("40000000000", 40_000_000_000), ("3000000000", 3_000_000_000), ("", None)])
def test_reported_pool_size(monkeypatch, value, want):
    from beatflow.device import _rmm_setup_pool_size

    monkeypatch.setenv("BEATFLOW_RMM_POOL_SIZE", value)
    assert _rmm_setup_pool_size() == want


def test_a_gpu_listed_twice_is_an_input_error():
    from beatflow.pipeline.cluster import make_task_runner

    with pytest.raises(InputError, match="--gpus 0,0: a GPU is listed twice"):
        make_task_runner("gpu", 2, gpus="0,0")


def test_gpu_workers_get_their_environment_as_pre_spawn_variables():
    # dask-cuda replaces a worker's `env` with CUDA_VISIBLE_DEVICES: Numba's RMM manager and the pool
    # size must reach the worker processes another way
    import dask

    from beatflow.pipeline.cluster import gpu_worker_env

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

    from beatflow.pipeline.cluster import GPU_WORKER_THREADS, make_task_runner

    fake = types.ModuleType("dask_cuda")
    fake.LocalCUDACluster = type("LocalCUDACluster", (), {})
    monkeypatch.setitem(sys.modules, "dask_cuda", fake)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {}}):
        runner = make_task_runner("gpu", 1, rmm_pool_size="50%", gpus="0,1")
    kw = runner.cluster_kwargs
    assert runner.cluster_class in ("dask_cuda.LocalCUDACluster", fake.LocalCUDACluster)
    assert GPU_WORKER_THREADS == 1 and kw["threads_per_worker"] == 1
    assert kw["rmm_pool_size"] == 0.5 and kw["rmm_async"] is True and kw["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert kw["rmm_maximum_pool_size"] == 0.5  # the pool is a budget: a partition that does not fit is an error
    assert kw["rmm_allocator_external_lib_list"] == ["cupy", "torch"]
    assert kw["preload"] == ["beatflow.pipeline.worker_preload"]  # dask-cuda appends its own: the configuration's is not read


def test_gpu_memory_setup_without_a_gpu_is_a_device_error(monkeypatch):
    import beatflow.device as B

    monkeypatch.setattr(B, "cupy_available", lambda: False)
    with pytest.raises(DeviceError, match="^no CUDA device, or CuPy is not installed here"):
        B.setup_gpu_memory(0.5)
    with pytest.raises(DeviceError, match="RMM allocator 'arena' is not one of async, pool"):
        B.setup_gpu_memory(0.5, "arena")


@pytest.mark.parametrize("value, total, want", [(0.5, 1000 * 256, 500 * 256), ("0.25", 1024, 256), (1000, 0, 768),
                                                (parse_pool_size("1kB"), 0, 768), (3e9, 0, 3_000_000_000)])
def test_pool_bytes_are_aligned_for_rmm(value, total, want):
    from beatflow.device import _pool_bytes

    assert _pool_bytes(value, total) == want


def test_a_pool_size_with_units_is_the_pipelines_to_read():
    """Sizes with units are read where Dask is (:func:`parse_pool_size`); the device's set-up takes numbers."""
    from beatflow.device import _pool_bytes
    from beatflow.errors import DeviceError

    with pytest.raises(DeviceError, match="RMM pool size '1kB': a share of the GPU"):
        _pool_bytes("1kB", 0)


@pytest.mark.skipif(not __import__("beatflow.device", fromlist=["x"]).cupy_available(), reason="needs a CUDA GPU")
def test_gpu_memory_setup_points_cupy_numba_and_torch_at_one_rmm_pool():
    """On a GPU (fresh process, as a plain `dask worker` starts): a pool that does not fit is a clear
    error; then the pool is made once, and CuPy, PyTorch and Numba allocations all land in it."""
    code = r'''
import json
import rmm
from beatflow.device import setup_gpu_memory
from beatflow.errors import DeviceError
try:
    setup_gpu_memory("1000TB")
    too_big = None
except DeviceError as e:
    too_big = str(e)
first = setup_gpu_memory(0.05, "async")
again = setup_gpu_memory(0.05, "async")
import cupy, torch
from numba import cuda
stats = rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource())
rmm.mr.set_current_device_resource(stats)
def used():
    c = stats.allocation_counts
    return int(c["current_bytes"] if isinstance(c, dict) else c.current_bytes)
n = 1 << 22
b0 = used(); a = cupy.zeros(n, cupy.uint8); b1 = used()
t = torch.zeros(n, dtype=torch.uint8, device="cuda"); b2 = used()
d = cuda.device_array(n, dtype="u1"); b3 = used()
print(json.dumps({"too_big": too_big, "first": first, "again": again, "cupy": b1 - b0, "torch": b2 - b1,
                  "numba": b3 - b2}))
'''
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["too_big"].startswith("cannot reserve an RMM pool of 1000000.00 GB on a GPU with"), got["too_big"]
    assert got["first"]["pool_created"] and not got["again"]["pool_created"]
    assert "CudaAsyncMemoryResource" in got["first"]["rmm_resources"]
    assert got["first"]["cupy_allocator"] == "rmm_cupy_allocator"
    assert got["first"]["torch_allocator"] == "pluggable"
    assert got["first"]["numba_memory_manager"] == "RMMNumbaManager"
    for lib in ("cupy", "torch", "numba"):
        assert got[lib] >= 1 << 22, (lib, got)


def test_training_goes_to_the_home_worker_even_where_its_data_is_elsewhere(monkeypatch):
    """What ``beatflow.pipeline.stages._follow`` submits (training, the engine build) runs on the first worker by
    address although its input lives on another (Dask alone would follow the data), and on another
    worker once that one is gone."""
    import uuid

    import numpy as np
    from distributed import Client, LocalCluster, get_worker

    import beatflow.pipeline.cluster as C
    import beatflow.pipeline.stages as S

    def where(x):
        return get_worker().address

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        monkeypatch.setattr(C, "flow_client", lambda: client)
        home, other = sorted(client.scheduler_info()["workers"])
        assert C.home_worker(client) == home and C.home_worker(None) is None
        held = []

        def new_data():
            """New data on the other worker (not hashed: scattering equal arrays gives one key, which an
            earlier task on the home worker has copied there)."""
            held.append(client.scatter(np.zeros(4_000_000), workers=[other], hash=False))
            return held[-1]

        # in a task group of its own each time (a large group of small tasks is "root-ish": placed
        # without regard to data)
        assert client.submit(where, new_data(), key=f"where-{uuid.uuid4().hex}").result() == other  # follows the data
        assert S._follow(None, None, where, new_data(), name=f"where{len(held)}x") == home
        client.retire_workers([home])
        assert S._follow(None, None, where, new_data(), name=f"where{len(held)}x") == other  # the home worker is gone


def _chatty(n, topic, fail=False):
    """Sends ``n`` events on ``topic`` from its worker, then returns where it ran (or fails)."""
    import time

    from distributed import get_worker

    from beatflow.pipeline.stages import _event_sender

    send = _event_sender(topic)
    for k in range(n):
        send((k, get_worker().address))
        time.sleep(0.15)
    if fail:
        raise ValueError("bad beats")
    return get_worker().address


def test_training_and_engine_run_on_the_home_worker_and_report_as_they_go(monkeypatch):
    """``beatflow.pipeline.stages._follow`` (how training and the engine build run): the function runs on the home
    worker, the messages it sends arrive in order while it runs, its result or its own exception comes
    back, and the subscription is gone afterwards."""
    from distributed import Client, LocalCluster

    import beatflow.pipeline.cluster as C
    import beatflow.pipeline.stages as S

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        monkeypatch.setattr(C, "flow_client", lambda: client)
        home = sorted(client.scheduler_info()["workers"])[0]
        got = []
        assert S._follow("t1", got.append, _chatty, 6, "t1", name="chatty") == home
        assert len(got) >= 4 and [k for k, _ in got] == list(range(len(got)))  # (the last may come after)
        assert {w for _, w in got} == {home}
        with pytest.raises(ValueError, match="bad beats"):
            S._follow("t2", got.append, _chatty, 1, "t2", fail=True, name="chatty")
        assert S._follow(None, None, _chatty, 2, None, name="quiet") == home
        # no home worker known (the client's view of the workers was empty once in CI): any worker,
        # not Dask's "allow_other_workers= without workers=" error
        monkeypatch.setattr(C, "home_worker", lambda c: None)
        assert S._follow(None, None, _chatty, 1, None, name="anywhere") in client.scheduler_info()["workers"]
        assert S._event_sender(None)("dropped") is None and S._event_sender("x")("no worker here") is None


@pytest.mark.skipif(not __import__("beatflow.device", fromlist=["x"]).cupy_available(), reason="needs a CUDA GPU")
def test_a_pool_too_small_is_a_clear_error_from_every_library():
    """On a GPU (fresh process): a worker's pool of 64 MB is a limit; 100 MB from CuPy, PyTorch or
    Numba inside ``device_memory`` is one DeviceError naming the sizes, not a hang or a bare bad_alloc."""
    code = r'''
import json
from beatflow.device import device_memory, pool_limit, setup_gpu_memory
from beatflow.errors import DeviceError
setup_gpu_memory("64MB", "async")
import cupy, torch
from numba import cuda
out = {"limit": pool_limit()}
n = 100_000_000
for lib, alloc in (("cupy", lambda: cupy.zeros(n, cupy.uint8)), ("torch", lambda: torch.zeros(n, dtype=torch.uint8, device="cuda")),
                   ("numba", lambda: cuda.device_array(n, dtype="u1"))):
    try:
        with device_memory(f"{lib} test", n):
            alloc()
        out[lib] = None
    except DeviceError as e:
        out[lib] = str(e)
small = cupy.zeros(1_000_000, cupy.uint8)  # what fits still works
out["after"] = pool_limit()
print(json.dumps(out))
'''
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["limit"] == [64_000_000, 0]
    for lib in ("cupy", "torch", "numba"):
        assert got[lib] == (f"{lib} test needs 100.0 MB on the GPU, more than this worker's RMM pool (limit 0.06 GB, "
                            "0.00 GB in use) can give: raise --rmm-pool-size or cut the stream into more --partitions"), \
            (lib, got[lib])
    assert got["after"][1] >= 1_000_000


def test_map_partitions_at_places_each_task_with_its_partition(monkeypatch, tmp_path):
    """``map_partitions(..., at=futures)`` runs each call on the worker holding its future: the second
    lead's partitions are read beside the first lead's, whatever that placement (here the reverse of the
    workers' order), and scoring runs on the partitions' workers after training gave one worker a copy
    of every partition's rows (Dask alone then drew the calls to that worker)."""
    import numpy as np
    from distributed import Client, LocalCluster, get_worker, wait

    import beatflow.pipeline.cluster as C
    import beatflow.pipeline.stages as S

    def where(item, *_):
        return item, get_worker().address

    def train(*rows):  # gathers every partition's rows on its worker, as fit_model does
        return sum(int(r.sum()) for r in rows)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        monkeypatch.setattr(C, "flow_client", lambda: client)
        workers = sorted(client.scheduler_info()["workers"])
        placed = [workers[1], workers[1], workers[0], workers[1]]
        beside = [client.scatter(np.full(10, k), workers=[w], hash=False) for k, w in enumerate(placed)]
        got = client.gather(S.map_partitions(where, ["a", "b", "c", "d"], name="where", at=beside))
        assert got == list(zip("abcd", placed))

        rows = [client.submit(np.full, 100_000, k, workers=[w], pure=False) for k, w in enumerate(placed)]
        home = client.submit(train, *rows, workers=[workers[0]], pure=False)
        assert home.result() == 100_000 * 6
        wait(rows)
        held = client.who_has(rows)
        assert all(workers[0] in held[r.key] for r in rows)  # the home worker holds a copy of every partition
        got = client.gather(S.map_partitions(where, ["a", "b", "c", "d"], rows, name="score", at=beside))
        assert [w for _, w in got] == placed


def _module(folder, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(body)


def test_import_in_background_imports_once_in_a_thread_and_swallows_a_failed_import(tmp_path, monkeypatch):
    import sys
    import threading

    from beatflow.device import import_in_background

    _module(tmp_path, "bf_bg_ok", "import threading\nIMPORTED_IN = threading.current_thread().name\n")
    _module(tmp_path, "bf_bg_bad", "raise ImportError('no driver here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("bf_bg_ok", "bf_bg_bad"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    thread = import_in_background("bf_bg_ok")
    assert thread is not None and thread.daemon and import_in_background("bf_bg_ok") in (thread, None)
    thread.join(10)
    assert sys.modules["bf_bg_ok"].IMPORTED_IN == thread.name != threading.current_thread().name
    assert import_in_background("bf_bg_ok") is None  # imported: nothing started
    bad = import_in_background("bf_bg_bad")
    bad.join(10)
    assert not bad.is_alive() and "bf_bg_bad" not in sys.modules  # no error here: where it is used


def test_the_dask_client_imports_the_module_of_a_results_type_without_fetching_it(tmp_path, monkeypatch):
    """Why a GPU run imports CuPy in its flow's process ahead of time: the client unpickles the type
    of each result a worker holds (here a class this process has not imported) as it learns the
    result is ready, before anything is gathered."""
    import sys

    from distributed import Client, LocalCluster, wait

    _module(tmp_path, "bf_result_type", "class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bf_result_type", raising=False)
    env = {"PYTHONPATH": str(tmp_path)}
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None, env=env) as cluster, \
            Client(cluster) as client:
        future = client.submit(eval, "(__import__('time').sleep(0.5), __import__('bf_result_type').Thing())[1]",
                               pure=False)
        assert "bf_result_type" not in sys.modules
        wait(future)  # (done once the client has taken the result's type in)
        assert "bf_result_type" in sys.modules


def _get_dask_client_error() -> str:
    from prefect_dask import get_dask_client

    try:
        with get_dask_client():
            return ""
    except ValueError as e:
        return str(e)


def test_the_flow_uses_its_runners_client_where_get_dask_client_would_open_its_own(prefect_server):
    """Why ``flow_client`` and not prefect-dask's ``get_dask_client`` (``flow_client``'s docstring): in the
    flow body ``get_dask_client`` connects a new client on each call, whose futures are cancelled when it
    closes (the stages' partition futures live from stage to stage), and in a Prefect task run in the
    flow's process (how the stages run) it finds no client; ``flow_client`` is the runner's own client,
    in both, the same on every call."""
    from prefect import flow, task
    from prefect_dask import DaskTaskRunner, get_dask_client

    from beatflow.pipeline.cluster import flow_client

    @task
    def in_a_task():
        return flow_client(), _get_dask_client_error()

    @flow(task_runner=DaskTaskRunner(cluster_kwargs={"n_workers": 1, "processes": False,
                                                     "dashboard_address": None}))
    def body():
        ours = flow_client()
        with get_dask_client() as theirs:
            opened = theirs is not ours and theirs.id != ours.id
            future = theirs.submit(int, "7", pure=False)
            got = future.result()
        kept = ours.submit(int, "8", pure=False)
        in_task, error = in_a_task()
        return opened, got, future.status, kept.result(), flow_client() is ours, in_task is ours, error

    opened, got, status, kept, same, same_in_task, error = body()
    assert opened and got == 7 and status == "cancelled"  # (its own client, its futures gone with it)
    assert kept == 8 and same and same_in_task
    assert "No global client found" in error
    assert flow_client() is None  # (outside a flow run)
