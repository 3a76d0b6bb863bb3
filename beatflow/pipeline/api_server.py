"""The run's temporary Prefect API server, started before anything else of the command.

Prefect's own temporary server (``SubprocessASGIServer``) starts when the flow does: the command first
imports Prefect, Dask and the flow (about 2.5 s on 2 cores), then the server module (1.7 s), then waits
for uvicorn to answer (4.3 s), then starts the cluster. :func:`start_early` starts the same uvicorn
command as the first thing a ``beatflow run`` does, with the standard library alone, so that the
server's start runs beside the imports, the figure processes' and the cluster's start; the flow then
waits only for what is left of it (:meth:`EarlyServer.wait`).

Prefect has no public call for "start the temporary server now, and let me wait for it later", so this
module spawns the command that ``SubprocessASGIServer`` spawns (uvicorn on ``prefect.server.api.server:
create_app``, ephemeral mode, no UI), in a session of its own as :func:`beatflow.pipeline.cluster.
_server_class` does (a Ctrl-C at the terminal must not kill it before the flow has reported).

It is used only where nothing else names an API: no ``PREFECT_API_URL`` in the environment, no profile
that may set one (:func:`wanted`); otherwise :func:`beatflow.pipeline.cluster.prefect_api` decides, as
before.

**The background server.** The server a run starts stays up after the run, for
``$BEATFLOW_API_LINGER_S`` seconds without a run (:data:`DEFAULT_LINGER_S`; 0: one temporary server per
run, stopped with it), and later runs use it at once instead of waiting for a server of their own
(:func:`background`). Its files are in the data folder (:func:`beatflow.pipeline.service.data_dir`):
:data:`STATE_NAME` (pid, port, URL, and the key of the Python, Prefect and database it serves: a run with
another key starts its own), its log :data:`LOG_NAME`, and one lease file per server: every run that uses
it holds a shared ``flock`` on that file for its life (the operating system drops it however the run
ends), and the server's watchdog (:func:`_watch`) exits once it could take the lock exclusively, with no
run holding it, for the whole linger time. Taking that exclusive lock before it removes the state file
is what keeps a run from picking a server that is going away. Nothing of this exists in Prefect
(its temporary server lives and dies with one process), hence it is written here.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib.util import find_spec
from pathlib import Path

from beatflow.errors import BeatflowError

#: how long the server may take to answer its health check
START_TIMEOUT_S = 120.0
#: the environment variable of the background server's idle time, and its default (seconds)
LINGER_VAR, DEFAULT_LINGER_S = "BEATFLOW_API_LINGER_S", 600.0
#: the background server's files in the data folder (its lease file: ``api-server-<port>.lease``)
STATE_NAME, START_LOCK_NAME, LOG_NAME = "api-server.json", "api-server.start.lock", "api-server.log"
#: how often the background server's watchdog looks at its lease file (seconds)
WATCH_S = 1.0


def wanted() -> bool:
    """Whether the command would start a temporary server: no API in the environment, and no Prefect
    profile that could name one (any profiles file that mentions ``PREFECT_API_URL``, or a profile chosen by
    ``PREFECT_PROFILE``: then Prefect's settings decide, later)."""
    if os.environ.get("PREFECT_API_URL") or os.environ.get("PREFECT_PROFILE"):
        return False
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml")
    try:
        return "PREFECT_API_URL" not in profiles.read_text()
    except OSError:  # (no profiles file: Prefect's defaults, no API)
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EarlyServer:
    """A temporary Prefect API server being started (:func:`start_early`)."""

    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port = proc, port
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.started = time.monotonic()
        self.ready_after_s: float | None = None

    def wait(self, timeout: float = START_TIMEOUT_S) -> str:
        """The API's URL once its health check answers.

        Raises
        ------
        BeatflowError
            The server exited, or did not answer within ``timeout`` seconds.
        """
        deadline = self.started + timeout
        while True:
            gone = self._exited()
            if gone:
                raise BeatflowError(gone)
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        self.ready_after_s = time.monotonic() - self.started
                        return self.api_url
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BeatflowError(f"{self._name()} did not answer within {timeout:.0f} s{self._where()}")
            time.sleep(0.05)

    def _exited(self) -> str | None:
        """Why the server can no longer answer (its process ended), or None."""
        if self.proc.poll() is None:
            return None
        return (f"the temporary Prefect API server exited with status {self.proc.returncode} before it answered "
                "(its output is in the run's log)")

    def _name(self) -> str:
        return "the temporary Prefect API server"

    def _where(self) -> str:
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop it (its whole process group) and wait for it; a kill after ``timeout`` seconds."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def linger_s() -> float:
    """The background server's idle time: ``$BEATFLOW_API_LINGER_S`` seconds, else :data:`DEFAULT_LINGER_S`
    (0: no background server).

    Raises
    ------
    InputError
        The variable is not a number of seconds, or is negative.
    """
    from beatflow.errors import InputError

    raw = os.environ.get(LINGER_VAR, "").strip()
    if not raw:
        return DEFAULT_LINGER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise InputError(f"{LINGER_VAR}={raw!r}: not a number of seconds (0 or more; 0: no background server)")
    return value


def _prefect_dir() -> Path | None:
    spec = find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _server_env() -> dict:
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_FINAL": "1", "PREFECT__SERVER_EPHEMERAL": "1"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def start_early() -> EarlyServer | BackgroundServer | None:
    """The run's server, being started now (None where Prefect is not installed): the background server
    (:func:`background`) unless ``$BEATFLOW_API_LINGER_S`` is 0 or the data folder cannot be written, else a
    temporary one, whose output goes to standard error, the run's log."""
    prefect_dir = _prefect_dir()
    if prefect_dir is None:
        return None
    if linger_s() > 0:
        try:
            return background()
        except OSError as e:  # (a data folder that cannot be written: a temporary server, as before)
            print(f"beatflow: no background Prefect server ({e}): a temporary one", file=sys.stderr, flush=True)
    port = _free_port()
    args = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]
    proc = subprocess.Popen(args, env=_server_env(), start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=sys.stderr.fileno())
    return EarlyServer(proc, port)


# -- the background server ----------------------------------------------------------------------------

def server_key() -> str:
    """What a background server must share with a run that uses it: the Python, Prefect's version and
    home, and the database."""
    import hashlib

    from importlib.metadata import version

    parts = [sys.executable, version("prefect"), os.environ.get("PREFECT_HOME", ""),
             os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _try_lock(f, kind: int, tries: int = 1, pause: float = 0.05) -> bool:
    import fcntl

    for i in range(tries):
        try:
            fcntl.flock(f.fileno(), kind | fcntl.LOCK_NB)
            return True
        except OSError:
            if i + 1 < tries:
                time.sleep(pause)
    return False


class BackgroundServer(EarlyServer):
    """A run's use of the background server: its lease (a shared lock on the server's lease file), held
    until :meth:`stop`; ``proc`` is set where this run started the server."""

    def __init__(self, state: dict, lease, proc: subprocess.Popen | None = None):
        self.state, self.lease, self.proc, self.port = state, lease, proc, int(state["port"])
        self.api_url = state["api_url"]
        self.started = time.monotonic()
        self.ready_after_s: float | None = None
        how = "started by this run" if proc is not None else f"pid {state['pid']}"
        self.description = f"the background server ({how}; it stops after {state['linger_s']:.0f} s without a run)"

    def _exited(self) -> str | None:
        from beatflow.pipeline.service import process_alive

        if process_alive(self.state):
            return None
        return f"{self._name()} exited before it answered{self._where()}"

    def _name(self) -> str:
        return f"the background Prefect API server (pid {self.state['pid']})"

    def _where(self) -> str:
        return f" (its log: {Path(self.state['log'])})"

    def stop(self, timeout: float = 10.0) -> None:
        """Give the lease back (the server stays up for the next run)."""
        if self.lease is not None:
            self.lease.close()
            self.lease = None


def background(linger: float | None = None) -> BackgroundServer:
    """The background server, with this run's lease on it: the running one, where one serves this
    run's key (:func:`server_key`) and is not going away, else a new one, spawned now (the caller
    waits for it with :meth:`BackgroundServer.wait`).

    Raises
    ------
    OSError
        The data folder cannot be written.
    """
    import fcntl

    import psutil

    from beatflow.pipeline.service import data_dir, process_alive, write_state

    folder = data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    linger = linger_s() if linger is None else linger
    key = server_key()
    with open(folder / START_LOCK_NAME, "a+") as start_lock:
        fcntl.flock(start_lock.fileno(), fcntl.LOCK_EX)  # (held for milliseconds: a read or a spawn)
        state = _read(folder / STATE_NAME)
        if state is not None and state.get("key") == key and process_alive(state):
            lease = open(state["lease"], "a+")
            # the watchdog holds its lock exclusively for an instant each look; for good once it goes away
            if _try_lock(lease, fcntl.LOCK_SH, tries=20) and _read(folder / STATE_NAME) == state:
                return BackgroundServer(state, lease)
            lease.close()
        port = _free_port()
        lease_path = folder / f"api-server-{port}.lease"
        lease = open(lease_path, "a+")
        fcntl.flock(lease.fileno(), fcntl.LOCK_SH)
        package_root = str(Path(__file__).resolve().parents[2])
        env = _server_env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        with open(folder / LOG_NAME, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from beatflow.pipeline.api_server import main; main()",
                 str(port), repr(linger), str(lease_path), str(folder / STATE_NAME), str(folder / START_LOCK_NAME)],
                env=env, cwd=folder, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT)
        state = {"pid": proc.pid, "pid_created": psutil.Process(proc.pid).create_time(), "port": port,
                 "api_url": f"http://127.0.0.1:{port}/api", "key": key, "linger_s": linger,
                 "lease": str(lease_path), "log": str(folder / LOG_NAME), "started": time.time()}
        write_state(state, folder / STATE_NAME)
        return BackgroundServer(state, lease, proc)


def _read(path: Path) -> dict | None:
    import json

    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    needed = ("pid", "port", "api_url", "key", "lease", "linger_s", "log")
    return state if isinstance(state, dict) and all(k in state for k in needed) else None


def main(argv: list[str] | None = None) -> None:
    """The background server's process: uvicorn on Prefect's app, and the watchdog that stops it.
    Arguments: port, linger seconds, lease file, state file, start lock."""
    import threading

    import uvicorn

    port, linger, lease_path, state_path, start_lock = (argv or sys.argv[1:])[:5]
    config = uvicorn.Config("prefect.server.api.server:create_app", factory=True, host="127.0.0.1",
                            port=int(port), log_level="error", lifespan="on")
    server = uvicorn.Server(config)
    threading.Thread(target=_watch, args=(server, Path(lease_path), Path(state_path), Path(start_lock),
                                          float(linger)), daemon=True, name="beatflow-api-watchdog").start()
    try:
        server.run()
    finally:
        _forget(Path(state_path), Path(lease_path))


def _forget(state_path: Path, lease_path: Path) -> None:
    state = _read(state_path)
    if state is not None and state["pid"] == os.getpid():
        state_path.unlink(missing_ok=True)
    lease_path.unlink(missing_ok=True)


def _watch(server, lease_path: Path, state_path: Path, start_lock: Path, linger: float) -> None:
    """Stop ``server`` once no run has held its lease for ``linger`` seconds. The exclusive lock taken
    last is kept until the process ends, and the state file goes first, under the start lock: a run
    then either holds a lease before that moment or never finds this server."""
    import fcntl

    lease = open(lease_path, "a+")
    idle_since = time.monotonic()
    while not server.should_exit:
        time.sleep(WATCH_S)
        if not _try_lock(lease, fcntl.LOCK_EX):
            idle_since = time.monotonic()  # a run holds it
            continue
        if time.monotonic() - idle_since < linger:
            fcntl.flock(lease.fileno(), fcntl.LOCK_UN)
            continue
        with open(start_lock, "a+") as sl:
            if not _try_lock(sl, fcntl.LOCK_EX):  # a run is choosing a server: look again later
                fcntl.flock(lease.fileno(), fcntl.LOCK_UN)
                continue
            _forget(state_path, lease_path)
        server.should_exit = True  # (the exclusive lease lock stays held until the process ends)
        return
