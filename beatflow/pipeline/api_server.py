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
            if self.proc.poll() is not None:
                raise BeatflowError(f"the temporary Prefect API server exited with status {self.proc.returncode} "
                                    "before it answered (its output is in the run's log)")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        self.ready_after_s = time.monotonic() - self.started
                        return self.api_url
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BeatflowError(f"the temporary Prefect API server did not answer within {timeout:.0f} s")
            time.sleep(0.05)

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


def start_early() -> EarlyServer | None:
    """Spawn the temporary server now (None where Prefect is not installed); its output goes to standard
    error, the run's log."""
    spec = find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        return None
    app_dir = Path(list(spec.submodule_search_locations)[0]).parent
    port = _free_port()
    args = [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_FINAL": "1", "PREFECT__SERVER_EPHEMERAL": "1"}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    proc = subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=sys.stderr.fileno())
    return EarlyServer(proc, port)
