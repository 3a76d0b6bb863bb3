"""A runner of ``beatflow serve``: a process that has imported what ``beatflow run`` and ``beatflow
score`` need, waits on a Unix socket for one command (:mod:`beatflow.pipeline.handoff`), runs it as
the command itself would (:func:`beatflow.cli.main`, on the client's standard streams, in its
working folder, with its environment) and exits.

Started by the service (:class:`beatflow.pipeline.service.Runners`) as ``python -m
beatflow.pipeline.start_runner --service-pid N`` (that tiny module calls :func:`main`; this module is
never run as ``__main__``, which would import a second copy of it), with ``PREFECT_API_URL`` set to
the service's API. While it waits it ends by itself once the service is gone.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from beatflow.pipeline import handoff, service


def prepare() -> None:
    """Import what the commands import before their flow runs (the garbage collector paused meanwhile,
    as the command does: :func:`beatflow.cli._long_lived_imports`), and start the report's figure
    processes."""
    from beatflow import cli

    with cli._long_lived_imports():
        import rich.console  # noqa: F401
        import rich.table  # noqa: F401
        import scipy.stats  # noqa: F401  (the classes' rule, in the flow's process)

        import beatflow.device  # noqa: F401
        import beatflow.engine.options  # noqa: F401
        import beatflow.io.sources  # noqa: F401
        import beatflow.io.store  # noqa: F401
        import beatflow.pipeline.caching  # noqa: F401
        import beatflow.pipeline.cluster  # noqa: F401  (Prefect, Dask, prefect_dask)
        import beatflow.pipeline.flow  # noqa: F401
        import beatflow.pipeline.inbox_flow  # noqa: F401
        from beatflow.report.pool import figure_pool

    figure_pool()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="beatflow-runner")
    p.add_argument("--service-pid", type=int, required=True)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    pid = os.getpid()
    path = service.socket_path(pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))  # (first: a path too long for a socket fails the runner before its imports)
    listener.listen(1)
    for s in (signal.SIGINT, signal.SIGTERM):  # (the service's stop, while it waits: a clean end)
        signal.signal(s, _stop)
    try:
        return _run(listener, path, args.service_pid, t0)
    except KeyboardInterrupt:
        return 0
    finally:
        service.remove_runner(pid)


def _stop(signum, frame):
    raise KeyboardInterrupt


def _run(listener: socket.socket, path, service_pid: int, t0: float) -> int:
    pid = os.getpid()
    prepare()
    state = {"pid": pid, "service_pid": service_pid, "socket": str(path), "state": "ready",
             "since": time.time(), "ready_after_s": round(time.monotonic() - t0, 2),
             "prefect_env": handoff.prefect_env(os.environ)}
    service.write_runner(state)
    conn = _wait_for_client(listener, service_pid)
    if conn is None:
        return 0
    listener.close()  # (a second client, in the queue meanwhile, is refused and tries another runner)
    path.unlink(missing_ok=True)
    return _serve(conn, state)


def _wait_for_client(listener: socket.socket, service_pid: int):
    """The first client's connection, or None once the service is gone."""
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
            conn.settimeout(None)
            return conn
        except TimeoutError:
            if os.getppid() != service_pid:
                return None


def _receive(conn: socket.socket):
    """The request and the client's three standard streams (file descriptors), or (None, [])."""
    conn.settimeout(handoff.ACCEPT_TIMEOUT_S)
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        lines = handoff.Lines(conn, data)
        request = lines.next()
    except (OSError, ValueError):
        return None, []
    conn.settimeout(None)
    if not isinstance(request, dict) or len(fds) != 3 or request.get("argv", [None])[0] not in handoff.COMMANDS:
        for fd in fds:
            os.close(fd)
        return None, []
    return request, fds


def _serve(conn: socket.socket, state: dict) -> int:
    request, fds = _receive(conn)
    if request is None:
        conn.close()
        return 0
    service.write_runner({**state, "state": "busy", "since": time.time(),  # (the service starts the next one)
                          "command": " ".join(["beatflow", *request["argv"]])})
    own = [os.dup(i) for i in range(3)]  # (the runner's log: its streams again once the command is done)
    for i, fd in enumerate(fds):  # the client's terminal (or pipes) in place of this process's
        os.dup2(fd, i)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    os.chdir(request["cwd"])
    os.umask(int(request.get("umask", 0o022)))
    env = {k: v for k, v in request["env"].items() if k not in handoff.SERVICE_SET}
    env.update({k: os.environ[k] for k in handoff.SERVICE_SET if k in os.environ})
    os.environ.clear()
    os.environ.update(env)

    from beatflow import cli, terminal

    lock = threading.Lock()
    done = threading.Event()

    def tell(msg: dict) -> None:
        with lock:
            try:
                handoff.send(conn, msg)
            except OSError:
                pass

    def exit_status(code: int) -> None:
        done.set()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        tell({"exit": code})

    terminal.before_exit(exit_status)  # (an interrupted run ends by force: os._exit)
    cli.OUT_CHOSEN.append(lambda final: tell({"out": str(final.resolve())}))
    threading.Thread(target=_listen, args=(conn, done), daemon=True, name="beatflow-runner-client").start()
    tell({"accepted": True})
    try:
        rc = cli.main(request["argv"])
    except SystemExit as e:  # (argparse: its usage line is on the client's standard error)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:  # (a signal before the command's own handlers were in place)
        rc = 130
    exit_status(rc)
    conn.close()
    for i, fd in enumerate(own):  # what the process's end writes (its exit handlers) is not the client's
        os.dup2(fd, i)
        os.close(fd)
    return 0  # (the command's status is the client's; the runner's own says it served)


def _listen(conn: socket.socket, done: threading.Event) -> None:
    """The client's signals, and its end: a dropped connection stops the run as Ctrl-C does."""
    while not done.is_set():
        try:
            b = conn.recv(1)
        except OSError:
            b = b""
        if done.is_set():
            return
        if b == b"T":
            os.kill(os.getpid(), signal.SIGTERM)
        elif b == b"I" or not b:
            os.kill(os.getpid(), signal.SIGINT)
            if not b:
                return
