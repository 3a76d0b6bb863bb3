"""Scheduled scoring: new recordings in an inbox are scored with the latest trained model.

No retraining: the model registered by the last ``train-and-score`` run is loaded (after its hash
is checked), its engine is taken from the engine cache (built once per model), each new file is
scored in its own task, its beats are appended to the results store, and the file is moved to
``done/`` or, on bad input, to ``failed/`` with the reason.

Any number of these flows may run on one inbox at once (a schedule and a manual run, several
workers): each item is claimed before it is scored (:func:`beatflow.io.store.claim_item`), so it is
scored by one of them, and content scored before is recognised by its sha256 and not scored again.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, unmapped

from beatflow.io.store import Store, StoreError, list_inbox, release_dead_claims
from beatflow.terminal import front_sigterm
from beatflow.pipeline.inbox import score_inbox_item


def cached_engine(store: Store, model_path: Path, meta: dict) -> str:
    """The model's validated engine from the store's engine cache (built once per model and config).

    Raises
    ------
    StoreError
        The model file does not load: ``torch.load(weights_only=True)`` refuses a file that holds more
        than weights (a pickle that would run code), or the file is not a saved model.
    """
    import pickle

    import numpy as np

    from beatflow.engine.cache import build_or_load_engine

    probe = np.random.default_rng(0).normal(scale=0.3, size=(256, meta["width"])).astype(np.float32)
    try:
        _, info = build_or_load_engine(str(model_path), probe, backend="onnxruntime", cache_dir=store.engines)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise StoreError(f"{model_path}: the registered model does not load ({_load_error(e)}); not used") from None
    return info["path"]


def _load_error(e: Exception) -> str:
    """What went wrong loading a model, in a few words (PyTorch's text is a page that suggests
    ``weights_only=False``, the very thing not to do with a file of unknown origin)."""
    import pickle
    import re

    if isinstance(e, pickle.UnpicklingError):
        found = re.search(r"unsupported GLOBAL (\S+)", str(e))
        return "torch.load(weights_only=True) refused it: " + (f"it needs {found.group(1)}, not plain weights"
                                                              if found else "not plain weights")
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@flow(name="score-new-recordings", log_prints=True)
def score_new_recordings(inbox: str, store: str = ".beatflow", fs: float | None = None, lead: int | str = 0,
                         column: str | None = None, confirm_lead: int | str | None = None,
                         confirm_column: str | None = None) -> dict:
    """Score every new recording in ``inbox`` and move it to ``inbox/done`` or ``inbox/failed``.

    Returns ``{"model": id, "processed": [...]}``: per item this run scored, ``item``, ``status``
    (``done``, ``failed``, ``duplicate``), ``reason``, ``beats``, ``flagged``, ``sha256`` and
    ``moved_to`` (items another scorer took are left out).

    ``lead`` / ``column``: the WFDB or EDF channel (index or label) / CSV or Parquet column to read.
    ``confirm_lead`` (WFDB, EDF) and ``confirm_column`` (CSV/Parquet): a second lead that checks the beats,
    as ``beatflow run --confirm-lead`` does (:mod:`beatflow.detect.leads`)."""
    front_sigterm()  # (a command's SIGTERM before Prefect's handler: beatflow.terminal)
    log = get_run_logger()
    st = Store(store)
    model_path, meta = st.latest_model()
    engine_path = cached_engine(st, model_path, meta)
    released = release_dead_claims(inbox)  # (items of scorers that died: before the listing, to be scored now)
    if released:
        log.warning("%d item(s) claimed by scorers that died are back in the inbox: %s", len(released),
                    ", ".join(p.name for p in released))
    items = list_inbox(inbox)
    log.info("%d new recording(s) in %s; model %s", len(items), inbox, meta["id"])
    done, failed = str(Path(inbox) / "done"), str(Path(inbox) / "failed")
    futures = score_inbox_item.map([str(p) for p in items], unmapped(str(st.root)), unmapped(str(engine_path)),
                                   unmapped(meta), unmapped(fs), unmapped(lead), unmapped(done), unmapped(failed),
                                   unmapped(column), unmapped(confirm_lead), unmapped(confirm_column))
    results = [r for r in (f.result() for f in futures) if r is not None]  # (None: taken by another scorer)
    if results:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(results, key="scored-recordings", description="recordings scored by this run")
    return {"model": meta["id"], "processed": results}
