"""The results store and model registry used by scheduled scoring, and the inbox of new recordings.

Layout under a store folder (default ``$BEATFLOW_STORE``)::

    models/<model id>/model.pt, model.json     one folder per trained model (model.json holds its sha256)
    models/latest.json                         which model scores new recordings
    results/recording=<name>/part-*.parquet    scored beats, one file per scoring of a recording
    engines/                                   cached inference engines

Every write is atomic (temporary file + ``os.replace``) and every results file has a unique
name, so concurrent writers never corrupt or lose rows and an interrupted write leaves nothing.
Models are loaded only after their sha256 matches the registry (``torch.load(weights_only=True)``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import BeatflowError, InputError


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class StoreError(BeatflowError):
    """The store has no usable model, or a file in it does not match its recorded hash."""


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
        """Path and metadata of the latest model, after checking its hash."""
        pointer = self.models / "latest.json"
        if not pointer.exists():
            raise StoreError(f"{self.root}: no trained model in the store (run train-and-score first)")
        latest = json.loads(pointer.read_text())
        folder = self.models / latest["id"]
        path = folder / "model.pt"
        if not path.exists() or sha256_of(path) != latest["sha256"]:
            raise StoreError(f"{path}: model file missing or its sha256 does not match the registry; not loaded")
        return path, json.loads((folder / "model.json").read_text())

    # -- results --------------------------------------------------------------------------------
    def append_results(self, recording: str, table) -> Path:
        """Write one scored recording as a new Parquet file of the results dataset (atomic)."""
        import io

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in recording)
        path = self.results / f"recording={safe}" / f"part-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex}.parquet"
        buf = io.BytesIO()
        table.drop(columns=["recording"], errors="ignore").to_parquet(buf, index=False)
        atomic_write_bytes(path, buf.getvalue())
        return path

    def read_results(self):
        """All scored beats (a pandas DataFrame with a ``recording`` column), empty if none."""
        import pandas as pd
        import pyarrow.dataset as ds

        if not self.results.exists() or not any(self.results.rglob("*.parquet")):
            return pd.DataFrame()
        dataset = ds.dataset(self.results, format="parquet", partitioning="hive",
                             exclude_invalid_files=True, ignore_prefixes=[".", "_"])
        return dataset.to_table().to_pandas()


# -- inbox ---------------------------------------------------------------------------------------
RECORDING_SUFFIXES = (".csv", ".parquet", ".npy")


def list_inbox(inbox) -> list[Path]:
    """New recordings in an inbox folder: CSV/Parquet/npy files and WFDB records (their ``.hea``)."""
    inbox = Path(inbox)
    if not inbox.is_dir():
        raise InputError(f"{inbox}: inbox folder does not exist")
    items = [p for p in sorted(inbox.iterdir()) if p.is_file() and not p.name.startswith(".")
             and (p.suffix.lower() in RECORDING_SUFFIXES or p.suffix == ".hea")]
    return items


def companions(item: Path) -> list[Path]:
    """The files that make up one inbox item (a WFDB record is its .hea plus the files of its stem)."""
    if item.suffix == ".hea":
        return sorted(p for p in item.parent.iterdir() if p.is_file() and p.stem == item.stem)
    return [item]


def move_item(item: Path, dest: Path, reason: str | None = None) -> Path:
    """Move an inbox item (with its companions) into ``dest``; write ``<name>.reason.txt`` if given."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in companions(item):
        shutil.move(str(p), str(dest / p.name))
    if reason is not None:
        atomic_write_bytes(dest / f"{item.name}.reason.txt", (reason + "\n").encode())
    return dest / item.name
