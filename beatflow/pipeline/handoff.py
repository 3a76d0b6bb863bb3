"""``beatflow run`` and ``beatflow score`` as thin clients of ``beatflow serve``: the command hands itself
to a ready runner of the service instead of importing Prefect, Dask and the flow (about 2.8 s on 2 cores).

The service keeps one runner ready (:class:`beatflow.pipeline.service.Runners`): a process
(:mod:`beatflow.pipeline.runner`) that has imported the flows, the CLI and the task runner, has
``PREFECT_API_URL`` set to the service's API and waits on a Unix socket in the data folder
(:data:`RUNNERS_DIR`, next to its state file ``<pid>.json``). A command, before it imports anything
heavy (:func:`try_handoff`, standard library only), finds the service's state file and a ready runner,
connects, and sends one request: its arguments, working folder, umask and environment, with its standard
input, output and error passed along the socket (``SCM_RIGHTS``). The runner puts those file
descriptors in place of its own and runs the command (:func:`beatflow.cli.main`) as the command
itself would have: its lines, the progress line on a terminal, its table and its errors reach the
user's terminal directly, and the terminal's width and whether it is a terminal are what they are.
The client waits for the exit status and exits with it; Ctrl-C (or SIGTERM) in the client is passed
on and the runner stops the run as a plain run stops (exit 130 or 143, the output folder undone);
if the client's connection drops, the runner stops the run too. A runner serves one command, then
exits; the service starts the next one as soon as a command starts.

No handoff (the command runs itself, on the service's cluster where it finds one, as before) when:
the command is not ``run`` or ``score``; ``--no-service``, ``--scheduler``, a ``--device`` that is not
the service's, ``BEATFLOW_NO_SERVICE`` or ``BEATFLOW_NO_HANDOFF`` is given; ``PREFECT_API_URL`` names another API; the command's ``PREFECT_*``
settings differ from the runner's (Prefect read them when it was imported); or no runner is ready
or answers (a socket left by a dead runner is removed).

Messages on the socket are JSON lines: the request (client to runner, with the descriptors), then
``{"accepted": true}``, ``{"out": <folder>, "existed": <bool>}`` (where the run writes) and
``{"exit": <status>}`` (runner to client). From the client, one byte ``I`` (SIGINT) or ``T``
(SIGTERM). A runner that ends without an exit status (killed) leaves the client to remove the
run's ``.partial`` folder (:func:`beatflow.pipeline.outputs.remove_stale_partials`) and exit 1.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from beatflow.pipeline.service import (pid_alive, read_runners, read_state, remove_runner, service_disabled,
                                       socket_path)

#: the ``PREFECT_*`` variables the service sets for its runners (a command's own values are not used)
SERVICE_SET = ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_ANALYTICS_ENABLED")
#: the commands a runner serves
COMMANDS = ("run", "score")
#: the options after which the command does not use the service (argparse also takes a unique prefix)
_OWN_CLUSTER = ("--no-service", "--scheduler")
#: how long a client waits for a runner to accept its request before it tries another
ACCEPT_TIMEOUT_S = 10.0


def handoff_disabled() -> bool:
    """``BEATFLOW_NO_HANDOFF`` is set (to anything but empty, 0 or false)."""
    return os.environ.get("BEATFLOW_NO_HANDOFF", "").strip().lower() not in ("", "0", "false", "no")


def prefect_env(env) -> dict:
    """The ``PREFECT_*`` settings of ``env`` that a runner must share with its client."""
    return {k: v for k, v in env.items() if k.startswith("PREFECT_") and k not in SERVICE_SET}


def send(conn: socket.socket, msg: dict, fds=None) -> None:
    data = (json.dumps(msg) + "\n").encode()
    if fds:
        socket.send_fds(conn, [data], list(fds))
    else:
        conn.sendall(data)


class Lines:
    """The JSON messages of a socket, one a line (:meth:`next`: None at its end)."""

    def __init__(self, conn: socket.socket, buf: bytes = b""):
        self.conn, self.buf = conn, buf

    def next(self):
        while b"\n" not in self.buf:
            try:
                chunk = self.conn.recv(65536)
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# -- the client ------------------------------------------------------------------------------------

def _uses_own_cluster(args: list[str], service_device: str) -> bool:
    """``args`` ask for a cluster of the command's own: ``--no-service``, ``--scheduler``, or a ``--device``
    that is not the service's (argparse takes unique prefixes of options too)."""
    for i, a in enumerate(args):
        opt, eq, value = a.partition("=")
        if len(opt) <= 3 or not opt.startswith("--"):
            continue
        if any(o.startswith(opt) for o in _OWN_CLUSTER):
            return True
        if len(opt) >= 4 and "--device".startswith(opt):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value not in ("auto", service_device):
                return True
    return False


def try_handoff(argv: list[str]) -> int | None:
    """Run the command ``argv`` (without the program's name) on a ready runner of the service and
    return its exit status, or None where it is not handed off (see the module's text): the caller
    then runs it itself."""
    if not argv or argv[0] not in COMMANDS or handoff_disabled() or service_disabled():
        return None
    state = read_state()
    if state is None or not pid_alive(state["pid"]) or _uses_own_cluster(argv[1:], state["device"]):
        return None
    api = os.environ.get("PREFECT_API_URL")
    if api and api.rstrip("/") != state["api_url"].rstrip("/"):
        return None
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:  # (a closed standard stream cannot be passed on)
        return None
    mine = prefect_env(os.environ)
    umask = os.umask(0o022)
    os.umask(umask)
    request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}
    for runner in read_runners():
        if runner.get("state") != "ready" or runner.get("service_pid") != state["pid"]:
            continue
        if runner.get("prefect_env") != mine:
            continue
        conn = _connect(runner, request)
        if conn is not None:
            return _relay(conn, runner)
    return None


def _connect(runner: dict, request: dict):
    """The connection to ``runner`` once it has accepted ``request`` (with this process's standard
    streams), or None (it is gone: its files are removed; or it took another client's command)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(ACCEPT_TIMEOUT_S)
        conn.connect(str(runner.get("socket") or socket_path(runner["pid"])))
        send(conn, request, fds=(0, 1, 2))
        reply = Lines(conn).next()
    except (OSError, ValueError):
        reply = None
    if not (isinstance(reply, dict) and reply.get("accepted")):
        conn.close()
        if not pid_alive(runner["pid"]):
            remove_runner(runner["pid"])
        return None
    conn.settimeout(None)
    return conn


def _relay(conn: socket.socket, runner: dict) -> int:
    """Wait for the runner's exit status, passing SIGINT and SIGTERM on to it."""
    sent = []

    def forward(signum, frame):
        sent.append(signum)
        try:
            conn.sendall(b"I" if signum == signal.SIGINT else b"T")
        except OSError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    lines, out = Lines(conn), None
    try:
        while True:
            try:
                msg = lines.next()
            except ValueError:
                msg = None
            if msg is None:
                break
            if "out" in msg:
                out = msg
            if "exit" in msg:
                return int(msg["exit"])
    finally:
        conn.close()
        for s, h in previous.items():
            signal.signal(s, h)
    return _runner_died(runner, out, sent)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _runner_died(runner: dict, out: dict | None, sent: list) -> int:
    """The runner ended without an exit status (killed): remove what its run left, say so."""
    pid = runner["pid"]
    t0 = time.monotonic()
    while _exists(pid) and time.monotonic() - t0 < 5:  # (the service reaps it within a fraction of a second;
        time.sleep(0.05)  # until then, as a zombie, it still owns its partial folder)
    removed = ""
    if out is not None and not _exists(pid):
        from beatflow.pipeline.outputs import remove_stale_partials

        gone = remove_stale_partials(Path(out["out"]))  # (the folder itself appears only once the run is done)
        if gone:
            removed = f"; removed its partial output {', '.join(str(p) for p in gone)}"
    if sent:
        sys.stderr.write("beatflow: interrupted\n")
        return 128 + sent[0]
    sys.stderr.write(f"beatflow: error: the service's runner (pid {pid}) ended before the command did{removed}\n")
    return 1
