"""A run's output folder: written as a temporary ``.partial`` folder beside it and renamed at the end,
so that a failed or interrupted run leaves no partial output; writes that go on in the background
while the flow does (:func:`write_in_background`) are waited for before the folder is moved or removed."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import datetime
from pathlib import Path

from beatflow.errors import InputError
from beatflow.terminal import done_interrupt, on_interrupt

OWNER = ".owner"  # "<host> <pid>" of the run writing a .partial folder


def default_out_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def remove_stale_partials(final: Path) -> list[Path]:
    """Remove the ``.partial`` folders that killed runs left next to ``final``.

    A run writes into ``.<name>.<random>.partial`` and renames it at the end; a run killed with
    SIGKILL cannot clean up. A folder is stale when its owner file names this host and a process
    that no longer exists (folders of other hosts, or without an owner file, are left alone).
    """
    host, out = socket.gethostname(), []
    for d in final.parent.glob(f".{final.name}.*.partial"):
        try:
            owner_host, pid = (d / OWNER).read_text().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue
        if owner_host != host or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(d, ignore_errors=True)
        out.append(d)
    return out


@contextlib.contextmanager
def run_folder(final: Path, log):
    """Yield the work folder of a run whose outputs go to ``final`` (which must not exist or be empty):
    renamed to ``final`` when the block ends, removed when it raises.

    Raises
    ------
    InputError
        ``final`` exists and is not empty.
    """
    if final.exists() and any(final.iterdir()):
        raise InputError(f"{final}: output folder exists and is not empty")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_partials(final):
        log.info("removed %s, left by a run that was killed", stale)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    (work / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    on_interrupt(work, lambda: shutil.rmtree(work, ignore_errors=True))  # (a command stopped by force)
    try:
        yield work
        if final.exists():
            final.rmdir()
        (work / OWNER).unlink(missing_ok=True)
        join_writes(work)
        os.replace(work, final)
    except BaseException as e:
        join_writes(work)  # (a write still going would leave a file in the folder removed here)
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(e, Exception):  # an interrupt keeps the undo: a worker may still write here
            done_interrupt(work)  # until the command has stopped it (beatflow.terminal.Interrupts)
        raise
    done_interrupt(work)


_WRITES: dict[str, list] = {}  # the background writes of each run's work folder


def write_in_background(work: Path, fn, *args):
    """``fn(*args)``, a write into ``work``, in a thread of its own while the flow goes on (a future);
    :func:`join_writes` waits for it before the folder is moved or removed."""
    writing = ThreadPoolExecutor(1, thread_name_prefix="beatflow-write")
    future = writing.submit(fn, *args)
    writing.shutdown(wait=False)
    _WRITES.setdefault(str(work), []).append(future)
    return future


def join_writes(work: Path) -> None:
    """Wait for the background writes into ``work`` (their errors are the flow's to raise)."""
    for future in _WRITES.pop(str(work), []):
        wait([future])
