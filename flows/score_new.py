"""Scheduled scoring: new recordings in an inbox are scored with the latest trained model.

No retraining: the model registered by the last ``train-and-score`` run is loaded (after its hash
is checked), its engine is taken from the engine cache (built once per model), each new file is
scored in its own task, its beats are appended to the results store, and the file is moved to
``done/`` or, on bad input, to ``failed/`` with the reason.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, unmapped

from beatflow.store import Store, list_inbox
from tasks.scoring import score_inbox_item


def cached_engine(store: Store, model_path: Path, meta: dict) -> str:
    """The model's validated engine from the store's engine cache (built once per model and config)."""
    import numpy as np

    from beatflow.engines import build_or_load_engine

    probe = np.random.default_rng(0).normal(scale=0.3, size=(256, meta["width"])).astype(np.float32)
    _, info = build_or_load_engine(str(model_path), probe, backend="onnxruntime", cache_dir=store.engines)
    return info["path"]


@flow(name="score-new-recordings", log_prints=True)
def score_new_recordings(inbox: str, store: str = ".beatflow", fs: float | None = None, lead: int = 0,
                         column: str | None = None, confirm_lead: int | None = None,
                         confirm_column: str | None = None) -> dict:
    """Score every new recording in ``inbox`` and move it to ``inbox/done`` or ``inbox/failed``.

    ``lead`` / ``column``: the WFDB channel / CSV or Parquet column to read. ``confirm_lead`` (WFDB) and
    ``confirm_column`` (CSV/Parquet): a second lead that checks the beats, as ``beatflow run
    --confirm-lead`` does (:mod:`beatflow.leads`)."""
    log = get_run_logger()
    st = Store(store)
    model_path, meta = st.latest_model()
    engine_path = cached_engine(st, model_path, meta)
    items = list_inbox(inbox)
    log.info("%d new recording(s) in %s; model %s", len(items), inbox, meta["id"])
    done, failed = str(Path(inbox) / "done"), str(Path(inbox) / "failed")
    futures = score_inbox_item.map([str(p) for p in items], unmapped(str(st.root)), unmapped(str(engine_path)),
                                   unmapped(meta), unmapped(fs), unmapped(lead), unmapped(done), unmapped(failed),
                                   unmapped(column), unmapped(confirm_lead), unmapped(confirm_column))
    results = [f.result() for f in futures]
    if results:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(results, key="scored-recordings", description="recordings scored by this run")
    return {"model": meta["id"], "processed": results}
