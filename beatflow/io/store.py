"""The results store and model registry used by scheduled scoring, and the inbox of new recordings.

Layout under a store folder (default ``$BEATFLOW_STORE``)::

    models/<model id>/model.pt, model.json     one folder per trained model (model.json holds its sha256)
    models/latest.json                         which model scores new recordings
    results/sha256=<sha256>/beats.parquet      the scored beats of one inbox item, keyed by the sha256 of its
                                               content: rows carry ``recording`` (its name) and ``sha256``;
                                               the file's metadata says who scored it, when, with which model
    results/recording=<name>/part-*.parquet    results of older stores (read, never written)
    engines/                                   cached inference engines

Layout of an inbox folder::

    <name>                                     new items: CSV/Parquet/npy files, WFDB records (.hea + companions)
    processing/<claim id>/                     an item being scored, and .owner.json (host, pid, start time)
    done/<name>                                scored items, and duplicates of content scored before (with
                                               a <name>.reason.txt that names the earlier scoring)
    done/<sha12>/<name>, done/<sha12>-2/...    the same, where the name was taken in done/ already
    failed/<name>, <name>.reason.txt           bad input and why (the same subfolders where a name is taken)

Nothing is ever overwritten: files are placed with ``os.link``, which fails where the name is
taken, and a WFDB record moves as a whole into a subfolder (its ``.hea`` names its ``.dat``).
Every write is atomic (temporary file, then ``os.replace`` or ``os.link``), so an interrupted
write leaves nothing (an inbox, and a store, need a file system with hard links: any local one, NFS). A results file is created only where none exists, so each content is scored
into the store once, whatever the number of scorers (the second one learns it is a duplicate).

An item is claimed before it is scored, by renaming it into ``processing/<claim id>/``: of two
scorers one wins, the other skips the item. Claims of processes of this host that died are
released (moved back to the inbox) by the next scorer (:func:`release_dead_claims`); those of this
process by :func:`release_claims` (interrupts). The owner's start time is part of its identity,
so a new process that reuses the pid is not taken for the owner.

Models are loaded only after their sha256 matches the registry (``torch.load(weights_only=True)``).
This module imports neither PyTorch nor Prefect: :meth:`Store.latest_model` is a cheap check of a
store before a command starts.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from beatflow.errors import BeatflowError, InputError

log = logging.getLogger("beatflow.io.store")


def _feed(h, path) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def sha256_of(path) -> str:
    """The sha256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    _feed(h, path)
    return h.hexdigest()


def item_sha256(files) -> str:
    """The content hash of an inbox item.

    A single file: the sha256 of its bytes (what ``sha256sum`` prints). Several (a WFDB record and its
    companions): the sha256 over each file's suffix, size and bytes, in the order of their suffixes;
    the file names are left out so that a copy under another name is recognised.
    """
    files = sorted((Path(p) for p in files), key=lambda p: p.suffix)
    if len(files) == 1:
        return sha256_of(files[0])
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.suffix}\0{p.stat().st_size}\0".encode())
        _feed(h, p)
    return h.hexdigest()


def _write_temp(path: Path, data: bytes, commit) -> None:
    """Write ``data`` to a temporary file beside ``path`` and ``commit(tmp, path)`` it; nothing is left
    of the temporary file, whatever happens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``path`` whole or not at all (replacing what was there)."""
    _write_temp(Path(path), data, os.replace)


def exclusive_write_bytes(path, data: bytes) -> None:
    """Write ``path`` whole or not at all, only if it does not exist.

    Raises
    ------
    FileExistsError
        ``path`` exists: of writers racing for one path, exactly one succeeds (``os.link`` of a complete
        temporary file is atomic and never replaces a file).
    """
    _write_temp(Path(path), data, os.link)


class StoreError(BeatflowError):
    """The store has no usable model, or a file in it does not match its recorded hash."""


class AlreadyScored(FileExistsError):
    """Content with this sha256 was scored into the store before; ``earlier`` is that scoring's record."""

    def __init__(self, sha256: str, earlier: dict | None):
        self.sha256, self.earlier = sha256, earlier or {"sha256": sha256}
        super().__init__(describe_scoring(self.earlier))


def describe_scoring(earlier: dict) -> str:
    """One line on an earlier scoring (a duplicate's reason)."""
    sha = earlier.get("sha256", "")
    what = f"{earlier['item']} " if earlier.get("item") else ""
    when = f" on {earlier['scored_at']}" if earlier.get("scored_at") else ""
    model = f" with model {earlier['model']}" if earlier.get("model") else ""
    return f"same content (sha256 {sha[:12]}) as {what}scored{when}{model}; no rows appended"


def _read_json(path: Path, keys=()) -> dict:
    """A JSON object with these keys, or a one-line StoreError."""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; the store is incomplete") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise StoreError(f"{path}: unreadable or not JSON ({str(e).splitlines()[0] if str(e) else e!r})") from None
    if not isinstance(obj, dict):
        raise StoreError(f"{path}: garbled (a JSON object expected)")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise StoreError(f"{path}: garbled (no {', '.join(missing)})")
    return obj


_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Store:
    root: Path

    def __init__(self, root) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def results(self) -> Path:
        return self.root / "results"

    @property
    def engines(self) -> Path:
        return self.root / "engines"

    # -- models ---------------------------------------------------------------------------------
    def register_model(self, model_path, meta: dict) -> str:
        """Copy a trained model into the registry and make it the latest; returns its id."""
        digest = sha256_of(model_path)
        model_id = time.strftime("%Y%m%d-%H%M%S-") + digest[:8]
        folder = self.models / model_id
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / "model.pt", Path(model_path).read_bytes())
        atomic_write_bytes(folder / "model.json", json.dumps({**meta, "sha256": digest, "id": model_id},
                                                              indent=1).encode())
        atomic_write_bytes(self.models / "latest.json", json.dumps({"id": model_id, "sha256": digest}).encode())
        return model_id

    def latest_model(self) -> tuple[Path, dict]:
        """Path and metadata of the latest model, after checking its hash (cheap: no PyTorch).

        Raises
        ------
        StoreError
            One line: no model registered, ``latest.json`` or ``model.json`` missing or garbled, the
            model file missing, or its sha256 not the one registered.
        """
        pointer = self.models / "latest.json"
        if not pointer.exists():
            raise StoreError(f"{self.root}: no trained model in the store (run train-and-score first)")
        latest = _read_json(pointer, ("id", "sha256"))
        model_id = latest["id"]
        if not isinstance(model_id, str) or model_id in ("", ".", "..") or Path(model_id).name != model_id:
            raise StoreError(f"{pointer}: garbled (model id {model_id!r})")
        path = self.models / model_id / "model.pt"
        if not path.is_file():
            raise StoreError(f"{path}: model file missing; not loaded")
        if sha256_of(path) != latest["sha256"]:
            raise StoreError(f"{path}: model file's sha256 does not match the registry; not loaded")
        meta = _read_json(path.with_name("model.json"), ("scale", "width", "threshold"))
        if meta.get("sha256", latest["sha256"]) != latest["sha256"]:
            raise StoreError(f"{path.with_name('model.json')}: its sha256 does not match the registry; not loaded")
        return path, {**meta, "id": model_id}

    # -- results --------------------------------------------------------------------------------
    def results_path(self, sha256: str) -> Path:
        """Where the beats of the content with this sha256 are (or will be)."""
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise ValueError(f"not a sha256 (64 lowercase hex digits): {sha256!r}")
        return self.results / f"sha256={sha256}" / "beats.parquet"

    def scoring(self, sha256: str) -> dict | None:
        """The record of the earlier scoring of this content (item, recordings, scored_at, model,
        host, pid, path), or None if it was never scored."""
        import pyarrow.parquet as pq

        path = self.results_path(sha256)
        try:
            about = json.loads((pq.read_schema(path).metadata or {}).get(b"beatflow", b"{}"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # (a results file it cannot read: the content was scored all the same)
            about = {}
        return {**about, "sha256": sha256, "path": str(path)}

    def append_results(self, sha256: str, table, about: dict | None = None) -> Path:
        """Write the beats of one scored item (all its recordings) as its results file, once.

        Parameters
        ----------
        sha256 : str
            The item's content hash (:func:`item_sha256`): the file's key.
        table : pandas.DataFrame
            The beats, with a ``recording`` column (the recording's name).
        about : dict, optional
            What to record of this scoring (e.g. ``item``, ``model``); kept in the file's metadata with
            ``scored_at``, ``host`` and ``pid``, and given back by :meth:`scoring`.

        Raises
        ------
        AlreadyScored
            This content was scored before (also by a scorer that won a race): nothing is written.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.results_path(sha256)
        if "recording" not in table.columns:
            raise ValueError("results need a 'recording' column")
        table = table.drop(columns=["sha256"], errors="ignore").assign(recording=table["recording"].astype(str))
        record = {**(about or {}), "sha256": sha256, "scored_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "host": socket.gethostname(), "pid": os.getpid(),
                  "recordings": sorted(set(table["recording"]))}
        t = pa.Table.from_pandas(table, preserve_index=False)
        t = t.replace_schema_metadata({**(t.schema.metadata or {}), b"beatflow": json.dumps(record).encode()})
        buf = pa.BufferOutputStream()
        pq.write_table(t, buf)
        try:
            exclusive_write_bytes(path, buf.getvalue().to_pybytes())
        except FileExistsError:
            raise AlreadyScored(sha256, self.scoring(sha256)) from None
        return path

    def read_results(self):
        """All scored beats (a pandas DataFrame with ``recording`` and ``sha256`` columns), empty if none.

        Rows of older stores (``results/recording=<name>/``) have no ``sha256``.
        """
        import pandas as pd

        layouts = (("sha256=*/beats.parquet", "sha256"), ("recording=*/part-*.parquet", "recording"))
        frames = [self._read(sorted(self.results.glob(pattern)), key) for pattern, key in layouts]
        frames = [f for f in frames if f is not None]
        if not frames:
            return pd.DataFrame()
        return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]

    def _read(self, files: list[Path], key: str):
        import pyarrow as pa
        import pyarrow.dataset as ds

        if not files:
            return None
        partitioning = ds.partitioning(pa.schema([(key, pa.string())]), flavor="hive")
        dataset = ds.dataset([str(p) for p in files], format="parquet", partitioning=partitioning,
                             partition_base_dir=str(self.results))
        return dataset.to_table().to_pandas()


# -- inbox ---------------------------------------------------------------------------------------
RECORDING_SUFFIXES = (".csv", ".parquet", ".npy", ".edf", ".bdf")
OWNER = ".owner.json"  # (hidden: never an inbox item nor a record's companion)


def list_inbox(inbox) -> list[Path]:
    """New recordings in an inbox folder: CSV/Parquet/npy/EDF/BDF files and WFDB records (their ``.hea``)."""
    inbox = Path(inbox)
    if not inbox.is_dir():
        raise InputError(f"{inbox}: inbox folder does not exist")
    return [p for p in sorted(inbox.iterdir()) if p.is_file() and _is_item(p)]


def _is_item(p: Path) -> bool:
    return not p.name.startswith(".") and (p.suffix.lower() in RECORDING_SUFFIXES or p.suffix == ".hea")


def companions(item: Path) -> list[Path]:
    """The files that make up one inbox item, the item last (a WFDB record is its .hea plus the other
    files of its stem; a CSV/Parquet/npy file of that stem is an item of its own)."""
    if item.suffix != ".hea":
        return [item]
    others = [p for p in item.parent.iterdir()
              if p.is_file() and p.stem == item.stem and p != item and not _is_item(p)]
    return [*sorted(others), item]


def _link_all(files: list[Path], folder: Path) -> bool:
    """Hard-link every file into ``folder`` under its name, or none of them (a name is taken).

    A name that already is the same file counts as linked: a move cut short is finished, not refused.
    """
    made = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for p in files:
            target = folder / p.name
            try:
                os.link(p, target)
                made.append(target)
            except FileExistsError:
                if not os.path.samefile(p, target):
                    raise
    except BaseException as e:
        for target in made:
            target.unlink(missing_ok=True)
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            return False
        raise
    return True


def _place(files: list[Path], dest: Path, sha256: str) -> Path:
    """Move ``files`` into ``dest``, or, where a name is taken there, into the first free one of
    ``dest/<sha12>``, ``dest/<sha12>-2``, ...; returns the folder. Never overwrites."""
    for n in range(1, 10_000):
        folder = dest if n == 1 else dest / (sha256[:12] if n == 2 else f"{sha256[:12]}-{n - 1}")
        if _link_all(files, folder):
            _unlink_sources(files)
            return folder
    raise OSError(f"{dest}: no free place for {files[-1].name}")


def _unlink_sources(files: list[Path]) -> None:
    """Remove the old names of files linked into their new place, in reverse order: the item before its
    companions (listed before it), so that a claim folder without its item has had every file placed."""
    for p in reversed(files):
        p.unlink(missing_ok=True)


def move_item(item: Path, dest: Path, reason: str | None = None, sha256: str | None = None) -> Path:
    """Move an inbox item (with its companions) into ``dest``, never overwriting; returns its new path.

    A name taken in ``dest`` sends the item (all its files) to ``dest/<sha12>/`` (then ``-2``, ...;
    ``sha12``: the first 12 hex digits of its content hash). ``reason``: written beside it as
    ``<name>.reason.txt``.
    """
    item = Path(item)
    files = companions(item)
    sha256 = sha256 or item_sha256(files)
    note = None
    if reason is not None:  # (in a hidden temporary folder beside the item: placed with it, or not at all)
        note = item.parent / f".{item.name}.{uuid.uuid4().hex}.reason" / f"{item.name}.reason.txt"
        atomic_write_bytes(note, (reason + "\n").encode())
    try:
        folder = _place([*files, note] if note else files, Path(dest), sha256)
    finally:
        if note is not None:
            shutil.rmtree(note.parent, ignore_errors=True)
    return folder / item.name


# -- claims --------------------------------------------------------------------------------------
# This process's live claims, by folder. No lock: a signal handler may call release_claims() in the
# thread it interrupted, which a held lock would deadlock; a dict's single operations are atomic,
# and who finishes or releases a claim is decided by one rename of its folder (_take).
_CLAIMS: dict[str, Claim] = {}
_ME: tuple | None = None


def _me() -> dict:
    """This process as a claim's owner: host, pid, and start time (a later process with this pid differs)."""
    global _ME
    if _ME is None or _ME[0] != os.getpid():
        import psutil

        _ME = (os.getpid(), {"host": socket.gethostname(), "pid": os.getpid(),
                             "started": psutil.Process().create_time()})
    return _ME[1]


def _alive(owner: dict) -> bool:
    """Whether a claim's owner may still run: a process of another host always may."""
    import psutil

    if owner.get("host") != socket.gethostname():
        return True
    try:
        pid, started = int(owner["pid"]), float(owner["started"])
    except (KeyError, TypeError, ValueError):  # (an owner that cannot be judged is left alone)
        return True
    try:
        p = psutil.Process(pid)
        # (the start time from /proc is the boot time, which the kernel rounds to whole seconds, plus
        # ticks: the same process may read up to a second apart; pid reuse within a second is not seen)
        return abs(p.create_time() - started) <= 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


@dataclass(eq=False)
class Claim:
    """An inbox item this process took for scoring: its files are in ``folder``.

    Exactly one of :meth:`finish` (into ``done/`` or ``failed/``) and :meth:`release` (back to the
    inbox) happens, whichever comes first; the other returns None.
    """

    inbox: Path
    folder: Path
    name: str
    pid: int = field(default_factory=os.getpid)
    _sha256: str | None = None

    @property
    def item(self) -> Path:
        """The listed file (the ``.hea`` of a record) as it is while claimed: score this."""
        return self.folder / self.name

    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = item_sha256(companions(self.item))
        return self._sha256

    def finish(self, dest, reason: str | None = None) -> Path | None:
        """Move the item into ``dest`` (never overwriting); None if it was released meanwhile."""
        taken = _take(self.folder, "finishing")
        _CLAIMS.pop(str(self.folder), None)
        if taken is None:
            return None
        try:
            moved = move_item(taken / self.name, Path(dest), reason=reason, sha256=self._sha256)
        except BaseException:  # (back to the inbox, for the next run)
            _return(taken, self.inbox, self.name)
            raise
        shutil.rmtree(taken, ignore_errors=True)
        return moved

    def release(self) -> Path | None:
        """Move the item back to the inbox; None if it was finished or released already."""
        taken = _take(self.folder, "releasing")
        _CLAIMS.pop(str(self.folder), None)
        return None if taken is None else _return(taken, self.inbox, self.name)


def _take(folder: Path, verb: str) -> Path | None:
    """Rename a claim's folder to a hidden name of its own, or None if it is gone: of the ones that
    try to finish or release a claim, the first one to rename its folder does it."""
    to = folder.with_name(f".{folder.name.lstrip('.').split('.')[0]}.{verb}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, to)
    except FileNotFoundError:
        return None
    return to


def _return(taken: Path, inbox: Path, name: str) -> Path | None:
    """Move a taken claim's item back to the inbox; leave it where a file of its name came meanwhile."""
    files = [p for p in sorted(taken.iterdir()) if p.is_file() and not p.name.startswith(".") and p.name != name]
    if not (taken / name).exists():  # (a finish cut short after every file had been placed)
        shutil.rmtree(taken, ignore_errors=True)
        return None
    files.append(taken / name)  # (the listed file last: the inbox shows the item once it is whole)
    if not _link_all(files, inbox):
        log.warning("%s: %s is in the inbox again; the claimed one stays in %s", inbox, name, taken)
        return None
    _unlink_sources(files)
    shutil.rmtree(taken, ignore_errors=True)
    return inbox / name


def claim_item(item) -> Claim | None:
    """Take an inbox item for scoring: move it into ``inbox/processing/<claim id>/``.

    The listed file (a record's ``.hea``) is taken by one rename, so that of scorers racing for it
    exactly one gets it; the companions of a record follow. Returns None if another scorer took the
    item first (it is no longer in the inbox).
    """
    item = Path(item)
    inbox = item.parent
    me = _me()
    claim_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{me['pid']}-{uuid.uuid4().hex[:8]}"
    folder = inbox / "processing" / claim_id
    folder.mkdir(parents=True)
    # the owner first: a claim folder with an item always says whose it is
    atomic_write_bytes(folder / OWNER, json.dumps({**me, "claim": claim_id, "item": item.name}).encode())
    claim = Claim(inbox, folder, item.name)
    _CLAIMS[str(folder)] = claim  # (before the rename: an interrupt from now on gives the item back)
    _release_at_exit()
    try:
        os.rename(item, folder / item.name)
    except FileNotFoundError:  # (taken by another scorer; or the folder by an interrupt's release)
        _CLAIMS.pop(str(folder), None)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    for p in companions(item)[:-1]:  # (listed after the rename: the .hea is gone, its companions are left)
        try:
            os.rename(p, folder / p.name)
        except FileNotFoundError:  # (gone, or the claim was released meanwhile: then they stay in the inbox)
            pass
    return claim


_AT_EXIT = []


def _release_at_exit() -> None:
    """Claims still held when the interpreter exits go back to the inbox (a killed process leaves its
    claims to :func:`release_dead_claims`)."""
    if not _AT_EXIT:
        _AT_EXIT.append(True)
        atexit.register(release_claims)


def release_claims(inbox=None) -> list[Path]:
    """Move every claim this process holds (in ``inbox``, or anywhere) back to its inbox.

    Safe from a signal handler or another thread while tasks run: a claim being finished is left to
    its task. Returns the items' paths in their inboxes.
    """
    where = Path(inbox).resolve() if inbox is not None else None
    out = []
    for claim in list(_CLAIMS.copy().values()):
        if claim.pid != os.getpid() or (where is not None and claim.inbox.resolve() != where):
            continue  # (a forked child does not own its parent's claims)
        try:
            back = claim.release()
        except OSError as e:  # one that cannot be moved must not keep the others in
            log.warning("%s: claim not released (%s)", claim.folder, e)
            continue
        if back is not None:
            out.append(back)
    return out


def _rmdir_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # (not empty, or not a folder)
        pass


def release_dead_claims(inbox) -> list[Path]:
    """Move the claims of processes of this host that no longer run back to the inbox.

    A scorer calls this before it lists the inbox. Claims of live processes, of other hosts (whose
    processes cannot be seen from here) and folders without a readable owner are left alone.
    Returns the items' paths in the inbox.
    """
    inbox = Path(inbox)
    processing = inbox / "processing"
    if not processing.is_dir():
        return []
    out = []
    for folder in sorted(processing.iterdir()):
        try:
            owner = json.loads((folder / OWNER).read_text())
            name = owner["item"]
        except FileNotFoundError:  # (a claim cut short before its owner was written holds nothing)
            _rmdir_if_empty(folder)
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(owner):
            continue
        taken = _take(folder, "releasing")  # (another scorer releasing it too: one of them does)
        back = _return(taken, inbox, name) if taken is not None else None
        if back is not None:
            out.append(back)
    return out
