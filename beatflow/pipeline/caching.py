"""Task caching and resume from cheap content hashes.

Cache keys are built from what identifies a result — the input's content hash, the parameters and
the code version — never from the partition arrays themselves (hashing them would cost a copy of
the stream). Cached results are small (peaks, paths, losses) and persisted under the cache folder;
the model files a cached training points to live there too, so a new run (or a run started again
after being killed) reuses what had finished and recomputes the rest.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from beatflow.version import __version__


#: ``--cache`` / ``$BEATFLOW_CACHE`` values that turn the run cache off
CACHE_OFF = ("off", "none", "no", "0", "false")


def run_cache(value: str | None = None) -> str | None:
    """The run cache folder of ``beatflow run --cache``: ``value``, else ``$BEATFLOW_CACHE``, else
    ``<user cache>/beatflow/runs`` (``~/.cache/beatflow/runs`` on Linux); None for ``off`` (or none, no, 0,
    false, empty). A run of an unchanged input with unchanged options there reuses its segmentation and
    its trained model (keyed by :func:`token`, with :func:`code_version`): a second run of the same
    recording skips the training."""
    import os

    if value is None:
        value = os.environ.get("BEATFLOW_CACHE")
    if value is None:
        from platformdirs import user_cache_dir

        return str(Path(user_cache_dir("beatflow")) / "runs")
    return None if value.strip().lower() in CACHE_OFF + ("",) else value


def _files_digest(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def code_version() -> str:
    """Hash of the sources of the package (a change invalidates the caches)."""
    root = Path(__file__).resolve().parents[1]  # the beatflow package
    files = sorted(root.rglob("*.py"))
    return f"{__version__}-{_files_digest(files)[:12]}"


def input_digest(path) -> str:
    """sha256 of an input file, or of every file of a WFDB folder (streamed, 1 MiB at a time)."""
    p = Path(path)
    files = sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for q in files:
        h.update(q.name.encode())
        with open(q, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def token(*parts) -> str:
    """A cache key from small JSON-able parts (and bytes)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def key_from_token(context, parameters) -> str | None:
    """Prefect ``cache_key_fn``: the task's explicit ``cache_token`` parameter (None: no caching)."""
    return parameters.get("cache_token")


def cached(task, cache_dir: str | None):
    """``task`` with persisted, token-keyed caching under ``cache_dir`` (unchanged if None)."""
    if not cache_dir:
        return task
    from prefect.filesystems import LocalFileSystem

    base = str(Path(cache_dir).resolve() / "results")
    storage = LocalFileSystem(basepath=base)
    # workers resolve the storage by reference, so it is saved as a block on the server
    storage.save(f"beatflow-cache-{hashlib.sha256(base.encode()).hexdigest()[:16]}", overwrite=True)
    return task.with_options(cache_key_fn=key_from_token, persist_result=True, result_storage=storage,
                             refresh_cache=False)
