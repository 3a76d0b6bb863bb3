"""``beatflow serve``: one standing Prefect server and one Dask cluster that later commands use.

Without it, every ``beatflow run`` starts a temporary Prefect API server and a Dask cluster of its own
and closes both at its end (seconds of each command). ``beatflow serve`` starts them once:

* the Prefect server (:func:`beatflow.pipeline.cluster.prefect_api`, uvicorn detached from the terminal,
  with Prefect's background services, no UI) on a SQLite database kept in the data folder
  (``PREFECT_API_DATABASE_CONNECTION_URL`` if set; with ``PREFECT_API_URL`` set, that API is used and
  no server is started);
* the Dask cluster of :func:`beatflow.pipeline.cluster.cluster_spec`, as a run's own cluster would be
  (``distributed.LocalCluster``, or ``dask_cuda.LocalCUDACluster`` with ``--device gpu``);

then writes the state file (:data:`STATE_NAME`: its pid, the API's URL, the scheduler's address,
device, workers, start time) and waits until SIGINT or SIGTERM, when it closes both and removes the
file. A lock held on :data:`LOCK_NAME` for its lifetime refuses a second service. ``--detach`` starts
it as a process detached from the terminal (``setsid``) whose output goes to :data:`LOG_NAME`, and returns once it is ready.

``beatflow run`` and ``beatflow score`` look for the service (:func:`find_service`: the state file, a
live pid, and both the API and the scheduler answering over HTTP) and use it as ``PREFECT_API_URL``
and ``--scheduler`` would; otherwise they start their own, as before.

The data folder: ``$BEATFLOW_DATA_DIR``, else ``platformdirs.user_data_dir("beatflow")``
(``~/.local/share/beatflow`` on Linux). Only the standard library is imported at module level: a
command reads the state file before it imports Prefect or Dask.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from beatflow.errors import BeatflowError

#: the service's files in the data folder
STATE_NAME, LOCK_NAME, LOG_NAME, DB_NAME = "service.json", "service.lock", "service.log", "prefect.db"
#: exit status of ``--status`` and ``--stop`` when no service is running
NOT_RUNNING = 3
#: how long a probe of the API or of the scheduler may take before the service counts as not answering
PROBE_TIMEOUT_S = 2.0
#: how often the service looks at its runners (a command that took the ready one gets a successor this soon)
RUNNER_POLL_S = 0.2
#: runners that end before any command reached them, in a row, after which the service starts no more
RUNNER_FAILURES = 3
#: with fewer cores, the next runner starts once the command before it has ended: its imports (about 5 s of
#: one core) beside a handed-off run on 2 cores made that run's flow 1.5 s slower (bench/results/cli.md)
RUNNER_OVERLAP_CORES = 5

log = logging.getLogger("beatflow")


def data_dir() -> Path:
    """``$BEATFLOW_DATA_DIR``, else the user's data folder for beatflow (platformdirs)."""
    if os.environ.get("BEATFLOW_DATA_DIR"):
        return Path(os.environ["BEATFLOW_DATA_DIR"])
    import platformdirs

    return Path(platformdirs.user_data_dir("beatflow", appauthor=False))


def state_path() -> Path:
    return data_dir() / STATE_NAME


# -- the state file ---------------------------------------------------------------------------------

def write_state(state: dict, path: Path | None = None) -> Path:
    """Write ``state`` as JSON at ``path`` (default :func:`state_path`) atomically: a reader sees the
    old file or the whole new one (a temporary file beside it, then :func:`os.replace`)."""
    import tempfile

    path = Path(path or state_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_state(path: Path | None = None) -> dict | None:
    """The state file's content, or None where there is none or it is not a service's state."""
    try:
        state = json.loads(Path(path or state_path()).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not all(k in state for k in ("pid", "api_url", "scheduler", "device")):
        return None
    return state


def remove_state(pid: int | None = None, path: Path | None = None) -> None:
    """Remove the state file (only if it is still the one of ``pid``, when given)."""
    path = Path(path or state_path())
    if pid is not None:
        state = read_state(path)
        if state is not None and state.get("pid") != pid:
            return
    path.unlink(missing_ok=True)


def process_alive(state: dict) -> bool:
    """The process that wrote ``state`` still runs (same pid and start time: not a reused pid)."""
    import psutil

    try:
        p = psutil.Process(int(state["pid"]))
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        started = state.get("pid_created")
        return started is None or abs(p.create_time() - float(started)) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def _get(url: str, timeout: float) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:  # (a local address: no proxy is asked)
        return r.read()


def probe(state: dict, timeout: float = PROBE_TIMEOUT_S) -> tuple[dict | None, str]:
    """Ask the service's Prefect API (``/health``) and its Dask scheduler (its HTTP server's
    ``/health`` and ``/json/counts.json``) whether they answer: ``({"workers": n}, "")``, or
    ``(None, why)``."""
    try:
        _get(state["api_url"].rstrip("/") + "/health", timeout)
    except Exception as e:
        return None, f"the Prefect API at {state['api_url']} does not answer ({e})"
    http = state.get("scheduler_http")
    try:
        if _get(f"{http}/health", timeout).strip() != b"ok":
            return None, f"the Dask scheduler at {state['scheduler']} is not healthy"
        counts = json.loads(_get(f"{http}/json/counts.json", timeout))
    except Exception as e:
        return None, f"the Dask scheduler at {state['scheduler']} does not answer ({e})"
    return {"workers": int(counts.get("workers", 0))}, ""


def find_service(timeout: float = PROBE_TIMEOUT_S) -> dict | None:
    """The running service's state (:func:`read_state`) with ``workers_now``, if it is up and answers;
    else None (a state file left by a dead service is removed; the reason goes to the log, at debug
    level)."""
    path = state_path()
    state = read_state(path)
    if state is None:
        return None
    if not process_alive(state):
        log.debug("beatflow serve: the state file %s is stale (pid %s is gone): own cluster", path, state["pid"])
        remove_state(state["pid"], path)
        return None
    seen, why = probe(state, timeout)
    if seen is None:
        log.debug("beatflow serve (pid %s): %s: own cluster", state["pid"], why)
        return None
    return {**state, "workers_now": seen["workers"]}


def service_disabled() -> bool:
    """``BEATFLOW_NO_SERVICE`` is set (to anything but empty, 0 or false)."""
    return os.environ.get("BEATFLOW_NO_SERVICE", "").strip().lower() not in ("", "0", "false", "no")


# -- the runners' files: beatflow.pipeline.runner, beatflow.pipeline.handoff ------------------------------

#: the runners' sockets and state files, in the data folder
RUNNERS_DIR = "runners"


def runners_dir() -> Path:
    return data_dir() / RUNNERS_DIR


def pid_alive(pid: int) -> bool:
    """Process ``pid`` exists and is no zombie (standard library: ``/proc`` where there is one)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    except (ValueError, TypeError, OverflowError):
        return False
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def runner_path(pid: int) -> Path:
    return runners_dir() / f"{pid}.json"


def socket_path(pid: int) -> Path:
    return runners_dir() / f"{pid}.sock"


def write_runner(state: dict) -> None:
    """Write a runner's state file atomically (a temporary file, then :func:`os.replace`)."""
    path = runner_path(state["pid"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def read_runners() -> list[dict]:
    """The runners' states (ready or busy), oldest first; unreadable files are skipped."""
    out = []
    for p in runners_dir().glob("*.json"):
        try:
            state = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and "pid" in state:
            out.append(state)
    return sorted(out, key=lambda s: s.get("since", 0))


def remove_runner(pid: int) -> None:
    """Remove a runner's state file and socket."""
    runner_path(pid).unlink(missing_ok=True)
    socket_path(pid).unlink(missing_ok=True)


def describe_runner(state: dict) -> str:
    """One line for ``beatflow serve --status``."""
    age = time.time() - float(state.get("since", time.time()))
    if state.get("state") == "busy":
        return f"runner pid {state['pid']}: running `{state.get('command', '?')}` for {age:.0f} s"
    return f"runner pid {state['pid']}: ready for {age:.0f} s (started in {state.get('ready_after_s', 0):.1f} s)"


# -- the lock: one service per data folder -----------------------------------------------------------

def acquire_lock():
    """Take the data folder's service lock for the life of this process (an open file, returned);
    released by the operating system when the process ends, however it ends.

    Raises
    ------
    BeatflowError
        Another service holds it.
    """
    import fcntl

    folder = data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK_NAME, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise BeatflowError(_already_running()) from None
    return f


def check_unlocked() -> None:
    """Raise as :func:`acquire_lock` would, without keeping the lock."""
    acquire_lock().close()


def _already_running() -> str:
    state = read_state()
    if state is not None and process_alive(state):
        return (f"a beatflow service already runs (pid {state['pid']}, scheduler {state['scheduler']}); "
                "`beatflow serve --stop` stops it")
    return f"a beatflow service is starting or stopping (its lock {data_dir() / LOCK_NAME} is held)"


# -- the service ------------------------------------------------------------------------------------

def serve(device: str = "auto", workers: int | None = None, rmm_pool_size=None, gpus: str | None = None,
          rmm_allocator: str = "async", ready=None) -> int:
    """Run the service in this process until SIGINT or SIGTERM (a ``KeyboardInterrupt`` here:
    :class:`beatflow.terminal.Interrupts`); ``ready(state)`` is called once it serves. Returns 0 after
    a clean stop.

    Raises
    ------
    BeatflowError
        A service already runs; the device, pool size or workers cannot be had (its subclasses).
    """
    from beatflow.device import gpu_count, resolve_device
    from beatflow.errors import InputError
    from beatflow.terminal import done_interrupt, on_interrupt

    lock = acquire_lock()
    try:
        dev = resolve_device(device)
        if dev == "gpu":
            n_gpus = gpu_count(gpus) or 1
            if workers and workers != n_gpus:
                raise InputError(f"--workers {workers}: --device gpu runs one worker per GPU ({n_gpus})")
            workers = n_gpus
        else:
            workers = workers or max(2, os.cpu_count() or 2)
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        if not os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):  # the server's database persists
            os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{data_dir() / DB_NAME}"
        from distributed import Client
        from prefect.settings import get_current_settings
        from prefect.utilities.importtools import from_qualified_name

        from beatflow.pipeline.cluster import cluster_spec, prefect_api

        logging.getLogger("distributed").setLevel(logging.WARNING)
        path = state_path()
        own_server = not get_current_settings().api.url  # (with PREFECT_API_URL set, that API: no server)
        with prefect_api(standing=True) as api_url:
            cluster_class, kwargs = cluster_spec(dev, workers, rmm_pool_size, gpus, rmm_allocator)
            with from_qualified_name(cluster_class)(**kwargs) as cluster, Client(cluster) as client:
                client.wait_for_workers(n_workers=workers, timeout=180)
                import psutil

                state = {"pid": os.getpid(), "pid_created": psutil.Process().create_time(), "api_url": api_url,
                         "scheduler": cluster.scheduler_address,
                         "scheduler_http": f"http://127.0.0.1:{cluster.scheduler.http_server.port}",
                         "device": dev, "workers": workers, "started": time.time(),
                         "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         "database": os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] if own_server else None}
                on_interrupt("service-state", lambda: remove_state(os.getpid(), path))
                write_state(state, path)
                runners = Runners(api_url)
                try:
                    if ready is not None:
                        ready(state)
                    while True:
                        runners.keep_one_ready()
                        time.sleep(RUNNER_POLL_S)
                except KeyboardInterrupt:
                    pass
                finally:
                    remove_state(os.getpid(), path)  # first: no command picks a closing service
                    runners.stop()
                    done_interrupt("service-state")
    finally:
        lock.close()
    return 0


class Runners:
    """The service's runners (:mod:`beatflow.pipeline.runner`): one is kept ready for the next command;
    once a command takes it (its state file says busy), the next one is started, at once on a machine of
    :data:`RUNNER_OVERLAP_CORES` cores or more, else when that command has ended (a command in between
    runs itself on the service's cluster).

    Each is ``python -m beatflow.pipeline.start_runner``, in a session of its own (a Ctrl-C at the
    service's terminal does not reach a command it runs; :meth:`stop` stops them), with
    ``PREFECT_API_URL`` set to the service's API; its output before a command reaches it goes to
    ``runners/runners.log`` of the data folder. A runner that ends before serving a command counts as
    failed; after :data:`RUNNER_FAILURES` in a row the service starts no more (commands then run
    themselves on the service's cluster, as without runners).
    """

    def __init__(self, api_url: str):
        import psutil

        self.api_url = api_url
        self.procs: dict = {}
        self.seen: set = set()
        self.failures = 0
        self.own = {p.pid for p in psutil.Process().children()}  # (the API server, the cluster's processes)
        self.overlap = (os.cpu_count() or 1) >= RUNNER_OVERLAP_CORES  # (the next runner starts beside a command)

    def keep_one_ready(self) -> None:
        states = {r["pid"]: r for r in read_runners()}
        self.seen.update(pid for pid in states if pid in self.procs)
        for pid, proc in list(self.procs.items()):
            if proc.poll() is not None:
                started = pid in self.seen or proc.returncode == 0  # (it got ready: its command may have failed)
                self.failures = 0 if started else self.failures + 1
                self.seen.discard(pid)
                remove_runner(pid)
                del self.procs[pid]
                self._orphans(kill=proc.returncode != 0)
                if self.failures == RUNNER_FAILURES:
                    log.warning("beatflow serve: %d runners in a row ended before serving a command (exit %s; "
                                "their log: %s): no more runners", RUNNER_FAILURES, proc.returncode,
                                self._log_path())
        if self.failures >= RUNNER_FAILURES:
            return
        self._orphans(kill=False)
        if not self.procs or (self.overlap and all(states.get(pid, {}).get("state") == "busy" for pid in self.procs)):
            self.start()

    def _orphans(self, kill: bool) -> None:
        """Reap the processes of ended runners that the service adopted (it is their subreaper:
        :func:`beatflow.terminal.adopt_orphans`); with ``kill``, after a runner that did not end
        cleanly (killed), end the ones still alive first (its figure processes)."""
        import multiprocessing

        import psutil

        own = self.own | set(self.procs) | {p.pid for p in multiprocessing.active_children()}
        try:
            orphans = [p for p in psutil.Process().children() if p.pid not in own]
        except psutil.Error:
            return
        for p in orphans:
            try:
                if kill and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    p.wait(timeout=2)
                os.waitpid(p.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError, OSError):
                pass

    def _log_path(self) -> Path:
        return runners_dir() / "runners.log"

    def start(self) -> None:
        import subprocess

        env = {**os.environ, "PREFECT_API_URL": self.api_url}
        env.pop("BEATFLOW_RUN_LOG", None)
        logfile = self._log_path()
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(logfile, "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", "beatflow.pipeline.start_runner",
                                     "--service-pid", str(os.getpid())], stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=f, env=env, start_new_session=True)
        self.procs[proc.pid] = proc

    def stop(self, timeout: float = 2.0) -> None:
        """SIGTERM to every runner (a command one runs stops as an interrupted run does, exit 143), then
        SIGKILL to those still there after ``timeout`` seconds; their files are removed."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for pid, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                proc.kill()
                proc.wait()
            remove_runner(pid)
        self.procs = {}
        self._orphans(kill=True)  # (those of runners that were killed)


def runner_lines() -> list[str]:
    """``--status``'s lines of the runners (a runner's files whose process is gone are removed)."""
    lines = []
    for r in read_runners():
        if not pid_alive(r["pid"]):
            remove_runner(r["pid"])
            continue
        lines.append(describe_runner(r))
    return lines or ["no runner ready (a command runs itself on the cluster)"]


def describe(state: dict) -> list[str]:
    """The lines that say where a service is."""
    up = time.time() - float(state.get("started", time.time()))
    h, rest = divmod(int(up), 3600)
    return [f"Dask scheduler  {state['scheduler']} ({state['device']}, {state.get('workers_now', state['workers'])} "
            f"worker(s))",
            f"Prefect API     {state['api_url']}",
            f"pid {state['pid']}, up {h} h {rest // 60} min {rest % 60} s"]


def status(out=print) -> int:
    """``beatflow serve --status``: 0 and where it is if the service answers, else 3 (a stale state file
    is removed)."""
    path = state_path()
    state = read_state(path)
    if state is None:
        out("beatflow serve: not running")
        return NOT_RUNNING
    if not process_alive(state):
        remove_state(state["pid"], path)
        out(f"beatflow serve: not running (removed the stale {path} of pid {state['pid']})")
        return NOT_RUNNING
    seen, why = probe(state)
    if seen is None:
        out(f"beatflow serve: pid {state['pid']} runs but does not serve: {why}")
        return NOT_RUNNING
    out("beatflow serve: running")
    for line in describe({**state, "workers_now": seen["workers"]}) + runner_lines():
        out("  " + line)
    return 0


def stop(timeout: float = 60.0, out=print) -> int:
    """``beatflow serve --stop``: SIGTERM to the service, wait for its end; 0, or 3 if none runs.

    Raises
    ------
    BeatflowError
        It is still running after ``timeout`` seconds.
    """
    import psutil

    path = state_path()
    state = read_state(path)
    if state is None or not process_alive(state):
        if state is not None:
            remove_state(state["pid"], path)
        out("beatflow serve: not running")
        return NOT_RUNNING
    try:
        psutil.Process(int(state["pid"])).terminate()
    except psutil.NoSuchProcess:
        pass
    deadline = time.monotonic() + timeout
    while process_alive(state):  # (a zombie counts as ended: its parent, if not init, reaps it)
        if time.monotonic() > deadline:
            raise BeatflowError(f"the service (pid {state['pid']}) is still running {timeout:.0f} s after SIGTERM")
        time.sleep(0.1)
    remove_state(state["pid"], path)  # (it removes it itself; not if it was killed)
    _stop_orphan_runners()
    out(f"beatflow serve: stopped (pid {state['pid']})")
    return 0


def _stop_orphan_runners() -> None:
    """Runners a killed service left (it stops its runners itself): SIGTERM, and their files removed."""
    import psutil

    for r in read_runners():
        if pid_alive(r["pid"]):
            try:
                p = psutil.Process(int(r["pid"]))
                if "beatflow.pipeline.start_runner" in " ".join(p.cmdline()):
                    p.terminate()
                    p.wait(timeout=5)
            except (psutil.Error, psutil.TimeoutExpired):
                pass
        remove_runner(r["pid"])


def start_detached(argv: list[str], timeout: float = 300.0, out=print) -> int:
    """``beatflow serve --detach``: the service as a process detached from the terminal (``setsid``; ``beatflow serve``
    with ``argv``), its output in :data:`LOG_NAME` of the data folder; returns 0 once it serves and
    prints where.

    Raises
    ------
    BeatflowError
        A service already runs, or the new one stopped (its error line) or did not start in time.
    """
    import subprocess

    check_unlocked()
    folder = data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    logfile = folder / LOG_NAME
    with open(logfile, "ab") as f:
        f.write(f"\n--- beatflow serve {' '.join(argv)} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        f.flush()
        child = subprocess.Popen([sys.executable, "-m", "beatflow.cli", "serve", *argv, "--verbose"],
                                 stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        rc = child.poll()
        if rc is not None:
            raise BeatflowError(f"the service did not start: {_last_error(logfile) or f'exit {rc}'} (log: {logfile})")
        state = read_state()
        if state is not None and state.get("pid") == child.pid and probe(state)[0] is not None:
            out(f"beatflow serve: running in the background (log {logfile})")
            for line in describe(state)[:2]:
                out("  " + line)
            return 0
        time.sleep(0.2)
    child.terminate()
    raise BeatflowError(f"the service did not start in {timeout:.0f} s (log: {logfile})")


def _last_error(logfile: Path) -> str:
    try:
        lines = logfile.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("beatflow: ")]
    return errors[-1].removeprefix("beatflow: ").removeprefix("error: ") if errors else ""
