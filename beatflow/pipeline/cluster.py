"""The Dask side: one Prefect API for the run, and the task runner (LocalCluster or LocalCUDACluster).

Every Dask worker process must talk to the same Prefect API as the flow; without one, each worker
would start its own temporary server (slow, and SQLite locks). :func:`prefect_api` makes sure one
exists, and :func:`make_task_runner` hands its URL to the workers' environment.
"""
from __future__ import annotations

import contextlib
import logging
import os

from distributed.diagnostics.plugin import WorkerPlugin
from prefect_dask import DaskTaskRunner

from beatflow.errors import DeviceError, InputError


@contextlib.contextmanager
def prefect_api(url: str | None = None, standing: bool = False, early=None):
    """Yield the Prefect API URL to use, starting one local server for the run if none is set.

    A configured ``PREFECT_API_URL`` (a running ``prefect server start``, or a test harness) is used
    as it is; else ``url`` (the API of ``beatflow serve``) for the duration; otherwise one server
    is started on 127.0.0.1 for the duration: a temporary one (Prefect's ephemeral mode, no
    background services), or with ``standing``, the service's (:mod:`beatflow.pipeline.service`:
    Prefect's background services run, on the database that ``PREFECT_API_DATABASE_CONNECTION_URL``
    names). ``early``: that temporary server, already being started by the command
    (:class:`beatflow.pipeline.api_server.EarlyServer`): waited for here, and stopped at the end (at
    once where a configured API or ``url`` leaves it unused).
    """
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    current = get_current_settings().api.url
    if early is not None and (current or url):
        early.stop()
        early = None
    if current:
        yield current
        return
    server = early
    if early is not None:
        url = early.wait()
        import sys

        what = getattr(early, "description", "the run's temporary server")
        print(f"beatflow: Prefect API {url}: {what}, ready {early.ready_after_s:.1f} s after the command asked for it",
              file=sys.stderr, flush=True)  # (standard error: the run's log)
    elif not url:
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        server = _server_class(ephemeral=not standing)()
        server.start(timeout=120)
        url = server.api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                _flush_logs()
    finally:
        if server is not None:
            server.stop()


def _server_class(ephemeral: bool = True):
    """Prefect's API server, started in a session of its own: temporary (``ephemeral``: Prefect's
    ephemeral mode, without its background services) or standing (``beatflow serve``).

    In the command's process group, a Ctrl-C at the terminal reached the server first: it died, and
    the interrupted flow then retried the dead API for about 150 s before it could report anything.
    In its own session only the command stops it (:meth:`stop`, or
    :func:`beatflow.terminal.kill_descendants`). Its output goes to standard error: the run's log.
    """
    import subprocess
    import sys

    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            # the command SubprocessASGIServer runs (uvicorn on Prefect's app factory, no UI)
            args = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                    "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                    "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_FINAL": "1",
                   **({"PREFECT__SERVER_EPHEMERAL": "1"} if ephemeral else {}),
                   **get_current_settings().to_environment_variables(exclude_unset=True)}
            if not ephemeral:
                env.pop("PREFECT__SERVER_EPHEMERAL", None)
            return subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=sys.stderr.fileno())

    return OwnSessionServer


def _flush_logs() -> None:
    """Send the flow's buffered log records before the temporary server goes away."""
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)
    except Exception:  # best effort: logs are also on the console
        pass


def _configure_worker_spawn() -> None:
    """Let worker processes keep glibc's default malloc trimming.

    distributed spawns workers with ``MALLOC_TRIM_THRESHOLD_=65536``, which returns freed memory to
    the OS eagerly; PyTorch's many small CPU allocations then become system calls and training ran
    3.5× slower in a worker than in a plain process (measured: 12.3 s vs 5.1 s for the same steps).
    """
    import dask
    import distributed  # noqa: F401  (registers distributed's config defaults)

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    dask.config.set({"distributed.nanny.pre-spawn-environ": env})
    # a Nanny writes its pre-spawn variables into its own process's environment, so a process started
    # by one that ran a Dask cluster (a benchmark script, a notebook) inherits the setting: drop it
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)


def gpu_worker_env(env: dict[str, str], pool) -> dict[str, str]:
    """Set the environment of dask-cuda's worker processes: ``env`` plus Numba's RMM memory manager
    and the pool size (what ``summary.json`` reports), as Nanny pre-spawn variables.

    dask-cuda replaces each worker's ``env`` option with its ``CUDA_VISIBLE_DEVICES``, so variables
    given there never reach a GPU worker; a Nanny writes ``distributed.nanny.pre-spawn-environ``
    into the environment before it starts the worker process. Returns the variables set.
    """
    import dask

    extra = {**env, "NUMBA_CUDA_MEMORY_MANAGER": "rmm.allocators.numba", "BEATFLOW_RMM_POOL_SIZE": str(pool)}
    current = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    dask.config.set({"distributed.nanny.pre-spawn-environ": {**current, **extra}})
    return extra


def worker_env() -> dict[str, str]:
    """Environment for Dask worker processes: the flow's Prefect API, quiet analytics, one BLAS thread, and a
    quick exit when the cluster closes (:func:`beatflow.pipeline.worker_preload.dask_teardown`)."""
    from prefect.settings import get_current_settings

    from beatflow.pipeline.worker_preload import FAST_EXIT_VAR

    env = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1", FAST_EXIT_VAR: "1"}
    if os.environ.get("BEATFLOW_RUN_LOG"):  # (beatflow.terminal.RunLog: the workers' output goes there)
        env["BEATFLOW_RUN_LOG"] = os.environ["BEATFLOW_RUN_LOG"]
    url = get_current_settings().api.url
    if url:
        env["PREFECT_API_URL"] = url
    return env


def parse_pool_size(value) -> float | int:
    """An RMM pool size as dask-cuda takes it: ``"80%"`` or ``0.8`` → ``0.8`` (fraction of the GPU),
    ``"20GB"`` or ``1e9`` → bytes (Dask's units: the workers' memory set-up, :mod:`beatflow.device`, then
    reads a number, without Dask).

    Raises
    ------
    InputError
        Not a size, or a fraction outside (0, 1].
    """
    import dask.utils

    text = str(value).strip()
    percent = text.endswith("%")
    try:
        v = float(text[:-1]) / 100.0 if percent else float(text)
    except ValueError:  # a size with a unit ("40GB")
        try:
            v = dask.utils.parse_bytes(text)
        except ValueError:
            raise InputError(f"--rmm-pool-size: cannot read {value!r} (e.g. 80%, 0.8 or 40GB)") from None
        if v <= 0:
            raise InputError(f"--rmm-pool-size must be positive, got {value!r}")
        return int(v)
    if not v > 0:
        raise InputError(f"--rmm-pool-size must be positive, got {value!r}")
    if percent and v > 1.0:
        raise InputError(f"--rmm-pool-size: {value!r} is more than the whole GPU")
    return float(v) if v <= 1.0 else int(v)


#: threads of each GPU worker: one. A GPU's partitions take milliseconds of kernels each, so threads
#: gain nothing since the stages' partition work runs as plain Dask tasks (with Prefect task runs per
#: partition, 4 threads overlapped their bookkeeping); and what a worker prepares once per thread (the
#: CUDA graphs of training and of the compiled engine are captured per thread) made the second and
#: third runs on a standing 4-thread worker pay it again (17.9 and 6.1 s against 4.1 s on the H200:
#: ``bench/results/gpu.md``)
GPU_WORKER_THREADS = 1

#: what each worker of the flow's own cluster preloads (:mod:`beatflow.pipeline.worker_preload`: its exit, which the
#: run waits for when it closes the cluster, without a last full garbage collection). Given as the
#: clusters' ``preload`` option: dask-cuda sets its GPU workers' own, so the configuration's is not read.
WORKER_PRELOAD = "beatflow.pipeline.worker_preload"


def make_task_runner(device: str = "cpu", workers: int | None = None, scheduler: str | None = None,
                     rmm_pool_size=None, gpus: str | None = None, rmm_allocator: str = "async"):
    """The Dask task runner of a flow run: the cluster of :func:`cluster_spec`, started and closed by
    the runner, or, with ``scheduler`` (the address of a Dask scheduler that already runs,
    ``tcp://host:port``: ``--scheduler``, or the standing service of :mod:`beatflow.pipeline.service`),
    that cluster. The other parameters are :func:`cluster_spec`'s.
    """
    logging.getLogger("distributed").setLevel(logging.WARNING)  # the scheduler runs in this process
    if scheduler:
        return DaskTaskRunner(address=scheduler)
    cluster_class, kwargs = cluster_spec(device, workers, rmm_pool_size, gpus, rmm_allocator)
    return DaskTaskRunner(cluster_class=cluster_class, cluster_kwargs=kwargs)


def cluster_spec(device: str = "cpu", workers: int | None = None, rmm_pool_size=None, gpus: str | None = None,
                 rmm_allocator: str = "async") -> tuple[str, dict]:
    """The flow's local Dask cluster: ``(class name, keyword arguments)``, as the run's own task runner
    (:func:`make_task_runner`) and ``beatflow serve`` (:mod:`beatflow.pipeline.service`) start it.

    Sets what the workers' processes must get before they are spawned: the environment of
    :func:`worker_env` (the Prefect API now configured), no eager malloc trimming
    (:func:`_configure_worker_spawn`) and, on the GPU, the RMM variables (:func:`gpu_worker_env`).

    Parameters
    ----------
    device : {"cpu", "gpu"}
        ``cpu``: a ``distributed.LocalCluster`` of ``workers`` single-threaded processes.
        ``gpu``: a ``dask_cuda.LocalCUDACluster`` (one worker per GPU, :data:`GPU_WORKER_THREADS`
        threads) with one RMM pool per GPU.
    workers : int, optional
        Number of CPU workers (default: the number of cores, at least 2).
    rmm_pool_size : str or float, optional
        RMM pool per GPU (default 80 % of the device, leaving headroom for cuDNN/ORT); see
        :func:`parse_pool_size`.
    gpus : str, optional
        GPUs to use, as ``CUDA_VISIBLE_DEVICES`` lists them (``"0,1"``); default all.
    rmm_allocator : {"async", "pool"}
        The pool behind RMM on each GPU: ``async``, CUDA's stream-ordered pool (``cudaMallocAsync``,
        RMM's ``CudaAsyncMemoryResource``, ``rmm_pool_size`` reserved up front), in which PyTorch can
        capture CUDA graphs (whole training steps); ``pool``, RMM's own ``PoolMemoryResource``.

    Raises
    ------
    InputError
        An unknown allocator, a GPU listed twice, a bad pool size.
    DeviceError
        ``gpu`` without dask-cuda.
    """
    env = worker_env()
    _configure_worker_spawn()
    if rmm_allocator not in ("async", "pool"):
        raise InputError(f"--rmm-allocator: {rmm_allocator!r} is not one of async, pool")
    if device == "gpu":
        if gpus:
            listed = [g.strip() for g in gpus.split(",") if g.strip()]
            if len(set(listed)) != len(listed):
                raise InputError(f"--gpus {gpus}: a GPU is listed twice (one worker per GPU)")
        try:
            import dask_cuda  # noqa: F401
        except ImportError:
            raise DeviceError("--device gpu needs dask-cuda and rmm (pip install 'beatflow[gpu]')") from None
        kwargs = {"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}
        pool = parse_pool_size(rmm_pool_size if rmm_pool_size is not None else 0.8)
        gpu_worker_env(env, pool)  # dask-cuda replaces a worker's `env` option: pre-spawn variables instead
        return "dask_cuda.LocalCUDACluster", {
            **kwargs,
            # dask-cuda reads a float as a fraction of the device ("80%" is not understood)
            "rmm_pool_size": pool,
            "rmm_maximum_pool_size": pool,  # the pool is the worker's budget: what does not fit is a clear error
            "rmm_async": rmm_allocator == "async",
            "rmm_allocator_external_lib_list": ["cupy", "torch"],
            "threads_per_worker": GPU_WORKER_THREADS,
            "dashboard_address": "127.0.0.1:0",
            "host": "127.0.0.1",
            "preload": [WORKER_PRELOAD],  # (dask-cuda appends its dask_cuda.initialize)
        }
    n = workers or max(2, os.cpu_count() or 2)
    from beatflow.pipeline.worker_preload import WARM_IMPORTS_VAR

    env = {**env, WARM_IMPORTS_VAR: "beatflow.engine.cache"}
    return "distributed.LocalCluster", {
        "n_workers": n,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
        "silence_logs": logging.WARNING,
        "env": env,
        "preload": [WORKER_PRELOAD],
    }


class GPUMemorySetup(WorkerPlugin):
    """Dask worker plugin: the GPU worker's memory as the flow's own workers have it, on any cluster.

    ``setup`` runs on every worker of the cluster, and on workers that join later: it keeps the RMM
    pool a ``dask cuda worker`` was started with, or reserves one of ``pool_size``, and makes CuPy,
    Numba and PyTorch allocate from it (:func:`beatflow.device.setup_gpu_memory`). A worker without
    a GPU fails its setup, and the run stops with that worker's one-line error.
    """

    name = "beatflow-gpu-memory"
    idempotent = False  # set up again on each run: a new worker, a changed pool size

    def __init__(self, pool_size=0.8, allocator: str = "async"):
        self.pool_size, self.allocator = pool_size, allocator

    def setup(self, worker=None):
        from beatflow.device import setup_gpu_memory

        try:
            setup_gpu_memory(self.pool_size, self.allocator)
        except DeviceError as e:
            raise DeviceError(f"worker {getattr(worker, 'address', '?')}: {e}") from None


def cluster_device(address: str, timeout: float = 30.0) -> str:
    """``"gpu"`` if every worker of the running cluster at ``address`` has CuPy and a CUDA device,
    else ``"cpu"``: what ``--device auto`` means with ``--scheduler`` (the workers' GPUs count, not
    this machine's).

    Raises
    ------
    DeviceError
        The scheduler cannot be reached, or it has no workers.
    """
    from distributed import Client

    from beatflow.device import cupy_available

    try:
        with Client(address, timeout=timeout) as client:
            has = client.run(cupy_available)
    except OSError as e:
        raise DeviceError(f"--scheduler {address}: cannot reach the Dask scheduler ({e})") from None
    if not has:
        raise DeviceError(f"--scheduler {address}: the Dask cluster has no workers")
    return "gpu" if all(has.values()) else "cpu"


def prepare_gpu_workers(pool_size=None, allocator: str = "async") -> dict:
    """Register :class:`GPUMemorySetup` on the flow's cluster (its own ``LocalCUDACluster``, or one
    given by ``--scheduler``) and return each worker's memory state ``{address: dict}``.

    Raises
    ------
    DeviceError
        A worker has no usable GPU (no CUDA device, CuPy or RMM, or no room for its pool).
    """
    client = flow_client()
    if client is None:
        return {}
    plugin = GPUMemorySetup(parse_pool_size(pool_size if pool_size is not None else 0.8), allocator)
    try:
        client.register_plugin(plugin, name=GPUMemorySetup.name)
    except DeviceError as e:
        raise DeviceError(f"--device gpu: a Dask worker cannot run on the GPU: {e}") from None
    from beatflow.device import gpu_memory_state

    return client.run(gpu_memory_state)


def prepare_cluster(device: str, workers: int | None, rmm_pool_size=None, rmm_allocator: str = "async"
                    ) -> tuple[int, dict]:
    """The flow's cluster made ready for a run: ``(workers, gpu_workers)``, the number of workers
    (``workers``, or with None, as many as a cluster given by ``--scheduler`` has) and, on the GPU, each
    worker's memory state (:func:`prepare_gpu_workers`: one RMM pool for CuPy, Numba and PyTorch).

    Raises
    ------
    DeviceError
        No worker starts (:func:`wait_for_workers`), or a worker has no usable GPU.
    """
    from beatflow.device import import_in_background

    if device == "gpu":  # the Dask client here meets CuPy arrays' types (`beatflow run` started this before)
        import_in_background("cupy")
    wait_for_workers(1)  # a cluster whose workers cannot start is an error, not a hang
    if workers is None:
        client = flow_client()
        workers = max(1, len(client.scheduler_info().get("workers", {}))) if client is not None else 1
    return workers, (prepare_gpu_workers(rmm_pool_size, rmm_allocator) if device == "gpu" else {})


def home_worker(client) -> str | None:
    """The cluster's home worker: the first by address (None without a client or workers).

    Training and the engine build go there (``beatflow.pipeline.stages._follow``; elsewhere if it is gone): they
    prepare per process what makes them fast (compiled steps, CUDA graphs, the engine's captured
    batch sizes, the engines loaded), and on a standing cluster that stays warm only if each run sends
    them to the same worker. Left to Dask, the worker with most of the gathered rows got them, and with
    two workers holding half each, run 2 went to the other worker and compiled again (H200: training
    16.1 s instead of 0.9 s).
    """
    workers = sorted(client.scheduler_info().get("workers", {})) if client is not None else []
    return workers[0] if workers else None


def wait_for_workers(n: int, timeout: float = 120.0) -> None:
    """Block until the flow's Dask cluster has ``n`` workers; a clear error if it does not get them.

    A worker that fails to start (a bad RMM pool size, no GPU memory, a missing package) leaves the
    cluster without workers, and every task would wait forever; this turns that into an error.

    Raises
    ------
    DeviceError
        Fewer than ``n`` workers after ``timeout`` seconds.
    """
    client = flow_client()
    if client is None:  # not on a Dask task runner
        return
    try:
        client.wait_for_workers(n_workers=n, timeout=timeout)
    except Exception:
        have = len(client.scheduler_info().get("workers", {}))
        raise DeviceError(f"the Dask cluster has {have} of {n} workers after {timeout:.0f} s: a worker failed to "
                          "start (its error is in the log above)") from None


def flow_client():
    """The Dask client of the current flow run's task runner (None outside a Dask-run flow).

    ``distributed.get_client()`` is not enough: the flow body runs in its own thread, where the
    runner's client is not the default one. Nor is prefect-dask's ``get_dask_client``, made for a
    task that runs on a worker: in the flow body it opens a new ``Client`` to the scheduler on each
    call (30 ms a call with an in-process cluster; the runner's own client here: microseconds), and
    the futures made through it are cancelled when it closes, while the partitions' futures must live
    from stage to stage; in a Prefect task run in the flow's process (the stages) it raises
    ``ValueError: No global client found`` (``tests/test_cluster.py`` checks both).
    """
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        runner = getattr(ctx, "task_runner", None)
        if isinstance(runner, DaskTaskRunner):  # its client (made on first use)
            return runner.client
        from distributed import get_client

        return get_client()
    except Exception:
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``getrusage``; Linux counts it in KiB, macOS in bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def run_on_workers(fn, *args) -> dict:
    """``fn(*args)`` on every Dask worker of the current flow's cluster: ``{worker address: result}``.

    Used for per-worker bookkeeping (RMM statistics, transfer counters); empty when no Dask client
    is reachable (e.g. another task runner).
    """
    client = flow_client()
    if client is None:
        return {}
    try:
        return client.run(fn, *args)
    except Exception as e:  # bookkeeping must not fail a run; say why it is missing
        logging.getLogger("beatflow").warning("%s on the workers failed: %s", getattr(fn, "__name__", fn), e)
        return {}
