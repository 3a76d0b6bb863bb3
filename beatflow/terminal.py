"""What a ``beatflow`` command shows on the terminal, and how it stops when interrupted.

Prefect, Dask and the processes they start (the temporary API server, the workers, the figure
processes) all write their logs and tracebacks to the process's standard error. A user wants one
line: what went wrong, where. :class:`RunLog` points file descriptor 2 of the command, and so of every
process it starts afterwards, at a log file of the run, and keeps the terminal for the command's
own lines (:func:`say`) and, on a terminal, a transient status line of the flow's progress.

:class:`Interrupts` turns Ctrl-C (SIGINT) and SIGTERM into a stop within a few seconds: the flow is
interrupted, what the run registered with :func:`on_interrupt` is undone (its partial output folder,
the inbox items it had claimed), every process the command started is killed, ``beatflow:
interrupted`` is printed and the command exits 130 (SIGINT) or 143 (SIGTERM).

Standard library only (no Prefect, no Dask): the command installs both before it imports them.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

#: how long an interrupted command may spend on a graceful stop before it is ended by force
GRACE_S = 3.0
#: the run logs kept in the log folder (older ones are removed when a command starts)
KEEP_LOGS = 50

_TERMINAL = None  # the terminal's stream while a RunLog holds file descriptor 2
_CURRENT = None  # that RunLog
_FAILED = None  # the last RunLog left by an exception


def log_dir() -> Path:
    """Where the run logs go: ``$BEATFLOW_LOG_DIR``, else ``$XDG_STATE_HOME/beatflow/logs``
    (``~/.local/state/beatflow/logs``)."""
    if os.environ.get("BEATFLOW_LOG_DIR"):
        return Path(os.environ["BEATFLOW_LOG_DIR"])
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "beatflow" / "logs"


def terminal():
    """The stream of the user's terminal (standard error as the command found it)."""
    return _TERMINAL if _TERMINAL is not None else sys.stderr


def current_log():
    """The :class:`RunLog` that holds standard error now, else the last one an error left (or None)."""
    return _CURRENT if _CURRENT is not None else _FAILED


def say(line: str) -> None:
    """Write one line of the command's own to the terminal."""
    stream = terminal()
    stream.write(line.rstrip("\n") + "\n")
    stream.flush()


class RunLog:
    """Send everything written to standard error, by this process and by the processes it starts
    from now on, to a log file of the run; the terminal keeps the command's own lines.

    A file descriptor, not logging handlers: Prefect's and Dask's console handlers hold
    ``sys.stderr``, worker and server processes inherit descriptor 2, and a traceback printed by
    any of them ends up in the log instead of between the user and the answer.

    Parameters
    ----------
    command : str
        Names the log file (``<time>-<pid>-<command>.log``).
    verbose : bool
        Keep everything on the terminal as it is (no log file).
    """

    def __init__(self, command: str, verbose: bool = False):
        self.command, self.verbose = command, verbose
        self.path: Path | None = None
        self._saved = None
        self._status = None

    def __enter__(self) -> RunLog:
        global _TERMINAL, _CURRENT
        if self.verbose:
            return self
        folder = log_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _prune(folder)
            self.path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self.command}.log"
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:  # no writable log folder: the terminal gets everything, as without a log
            self.path = None
            return self
        sys.stderr.flush()
        self._saved = os.dup(2)
        os.dup2(fd, 2)
        os.close(fd)
        _TERMINAL = os.fdopen(os.dup(self._saved), "w", buffering=1, encoding="utf-8", errors="replace")
        _CURRENT = self
        os.environ["BEATFLOW_RUN_LOG"] = str(self.path)
        logging.captureWarnings(True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _FAILED
        if exc_type is not None and self.path is not None and not issubclass(exc_type, KeyboardInterrupt):
            import traceback

            traceback.print_exception(exc_type, exc, tb)  # (into the log: the terminal gets one line)
        self.close()
        if exc_type is not None and self.path is not None:
            _FAILED = self  # (the command's error line, printed after this, says where the log is)

    def close(self) -> None:
        global _TERMINAL, _CURRENT
        self.stop_status()
        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        if _TERMINAL is not None:
            _TERMINAL.flush()
            _TERMINAL.close()
            _TERMINAL = None
        _CURRENT = None
        os.environ.pop("BEATFLOW_RUN_LOG", None)

    def where(self) -> str:
        """`` (details: <log>)`` for an error line, or nothing without a log."""
        return f" (details: {self.path})" if self.path else ""

    def show_progress(self, loggers=("prefect.flow_runs", "beatflow")) -> None:
        """On a terminal, a transient status line with the latest message of the flow's log."""
        stream = terminal()
        if self.verbose or not getattr(stream, "isatty", lambda: False)():
            return
        from rich.console import Console

        status = Console(file=stream, stderr=True).status("beatflow: starting", spinner="dots")
        status.start()
        handler = _StatusHandler(status)
        for name in loggers:
            logging.getLogger(name).addHandler(handler)
        self._status = (status, handler, loggers)

    def stop_status(self) -> None:
        if self._status is None:
            return
        status, handler, loggers = self._status
        self._status = None
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)
        status.stop()


class Progress:
    """Work in parts (a stage's partitions) for the status line: ``<stage>: <done>/<total> partitions,
    ETA <s>``, the time left estimated from the parts done so far. :meth:`done` may be called from any
    thread (the Dask client's callbacks); without a status line (no terminal, ``-v``) it only counts."""

    def __init__(self, stage: str, total: int, what: str = "partitions"):
        self.stage, self.total, self.what = stage, int(total), what
        self.n = 0
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    def text(self) -> str:
        line = f"{self.stage}: {self.n}/{self.total} {self.what}"
        if 0 < self.n < self.total:
            left = (time.monotonic() - self._t0) / self.n * (self.total - self.n)
            line += f", ETA {left:.0f} s" if left < 90 else f", ETA {left / 60:.1f} min"
        return line

    def done(self, *_) -> None:
        with self._lock:
            self.n += 1
            text = self.text()
        status_line(text)


def status_line(text: str) -> None:
    """Show ``text`` on the running command's status line, if it has one (see :meth:`RunLog.show_progress`)."""
    log = _CURRENT
    st = getattr(log, "_status", None) if log is not None else None
    if st is not None:
        try:
            st[0].update(f"beatflow: {text[:110]}")
        except Exception:  # (a status line stopped meanwhile)
            pass


class _StatusHandler(logging.Handler):
    def __init__(self, status):
        super().__init__(logging.INFO)
        self.status = status

    def emit(self, record) -> None:
        try:
            text = record.getMessage().splitlines()[0]
        except Exception:
            return
        self.status.update(f"beatflow: {text[:110]}")


def _prune(folder: Path) -> None:
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime)
    for old in logs[:-KEEP_LOGS] if len(logs) > KEEP_LOGS else []:
        old.unlink(missing_ok=True)


# -- interrupts ------------------------------------------------------------------------------------
_CLEANUPS: dict[object, object] = {}
_CLEANUPS_LOCK = threading.Lock()


_AT_ONCE: dict[object, object] = {}


def on_interrupt(key, fn, at_once: bool = False) -> None:
    """Run ``fn()`` if the command is interrupted (until :func:`done_interrupt` with the same key).

    ``at_once``: in the signal handler itself, before the flow unwinds: for what the flow's threads
    would otherwise go on with meanwhile (an inbox item being scored goes back to the inbox now, not
    after its scoring has finished). ``fn`` must then take no locks.
    """
    with _CLEANUPS_LOCK:
        (_AT_ONCE if at_once else _CLEANUPS)[key] = fn


def done_interrupt(key) -> None:
    with _CLEANUPS_LOCK:
        _CLEANUPS.pop(key, None)
        _AT_ONCE.pop(key, None)


def _run_at_once() -> None:
    for fn in list(_AT_ONCE.values()):  # (no lock: a signal handler may interrupt a holder of it)
        try:
            fn()
        except Exception:
            pass


def run_cleanups() -> None:
    """Undo what the interrupted run registered, most recent first; each at most once."""
    with _CLEANUPS_LOCK:
        fns = list(_CLEANUPS.values())[::-1]
        _CLEANUPS.clear()
    for fn in fns:
        try:
            fn()
        except Exception:  # an undo that fails must not keep the others from running
            pass


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (Linux: ``PR_SET_CHILD_SUBREAPER``).

    A process whose parent dies (a compile worker of a killed Dask worker, say) is otherwise handed to
    init, out of :func:`kill_descendants`' sight; as this process's child it stays in it. Elsewhere,
    or where the call is refused, nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        pass


def kill_descendants(rounds: int = 5) -> None:
    """Kill every process this one started, and theirs (workers, the API server, figure processes),
    again until none is left: one being started meanwhile (a worker's compile process) is killed in
    the next round."""
    try:
        import psutil
    except ImportError:  # (psutil comes with distributed)
        return
    for _ in range(rounds):
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if not children:
            return
        for p in children:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=1)


class Interrupts:
    """SIGINT and SIGTERM as a quick, clean stop of the command (see the module's text).

    The first signal raises :class:`KeyboardInterrupt` in the main thread, so the flow and the
    context managers around it unwind as usual (Prefect marks the run crashed, the partial output
    is removed); a watchdog ends the command by force if that takes longer than :data:`GRACE_S`, and a
    second signal does so at once.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self) -> Interrupts:
        global _ACTIVE
        _ACTIVE = self
        adopt_orphans()
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = None
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)

    def _first(self, signum) -> None:
        """The first signal, whichever handler took it: undo what cannot wait, arm the watchdog."""
        self.signum = signum
        _run_at_once()
        timer = threading.Timer(GRACE_S, self.finish)
        timer.daemon = True
        timer.start()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            self.finish()
        self._first(signum)
        raise KeyboardInterrupt

    def front(self) -> None:
        """Take SIGTERM first while a flow runs: Prefect's engine installs a handler of its own for the
        flow run (it raises its ``TerminationSignal`` and, once it has marked the run crashed, sends the
        signal again to the handler it replaced: ours). Ours now runs before Prefect's as well, so the
        undo that cannot wait and the watchdog start with the signal, not after Prefect's report."""
        if threading.current_thread() is not threading.main_thread():
            return
        prefects = signal.getsignal(signal.SIGTERM)
        if prefects == self._handle or not callable(prefects):
            return

        def first_then_prefects(signum, frame):
            if self.signum is None:
                self._first(signum)
            prefects(signum, frame)

        signal.signal(signal.SIGTERM, first_then_prefects)

    def finish(self) -> None:
        """Undo, kill, say so and exit (from the main thread after the unwinding, or the watchdog)."""
        kill_descendants()  # first: a worker must not write into what the undo removes
        run_cleanups()
        try:
            say("beatflow: interrupted")
            sys.stdout.flush()
        except Exception:  # (a terminal gone: the exit status still counts)
            pass
        finally:
            for fn in list(_BEFORE_EXIT):
                try:
                    fn(self.exit_code)
                except Exception:
                    pass
            os._exit(self.exit_code)


_ACTIVE: Interrupts | None = None
_BEFORE_EXIT: list = []


def before_exit(fn) -> None:
    """Call ``fn(exit_code)`` when an interrupted command ends by force (:meth:`Interrupts.finish`),
    after its undo and its last line, just before the process exits (a runner of ``beatflow serve``
    tells its client the exit status: :mod:`beatflow.pipeline.runner`)."""
    _BEFORE_EXIT.append(fn)


def front_sigterm() -> None:
    """Called by a flow as it starts: where a command's :class:`Interrupts` is active, SIGTERM reaches
    it before Prefect's own handler (:meth:`Interrupts.front`); elsewhere nothing."""
    if _ACTIVE is not None:
        _ACTIVE.front()


def ignore_interrupts_in_child() -> None:
    """For processes the command starts (workers, figure processes): a Ctrl-C at the terminal reaches
    the whole process group, and the command stops them itself; left to the signal they would die
    printing tracebacks of their own."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
