"""Scheduled scoring: new recordings in an inbox are scored with the latest trained model.

No retraining: the model registered by the last ``train-and-score`` run is loaded (after its hash
is checked), its engine is taken from the engine cache (built once per model), each new file is
scored in its own task, its beats are appended to the results store, and the file is moved to
``done/`` or, on bad input, to ``failed/`` with the reason.
"""
from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger, unmapped

from beatflow.store import Store, atomic_write_bytes, list_inbox, sha256_of
from tasks.scoring import score_inbox_item


def cached_onnx_engine(store: Store, model_path: Path, meta: dict) -> Path:
    """The model's ONNX engine from the store's cache, exported and validated once per model hash."""
    import numpy as np

    from beatflow.engine import OnnxRuntimeEngine, export_onnx, validate_engine
    from beatflow.model import Scorer, load_model

    path = store.engines / f"{meta['sha256']}.onnx"
    sidecar = path.with_suffix(".sha256")
    if path.exists() and sidecar.exists() and sidecar.read_text().strip() == sha256_of(path):
        return path
    scorer = Scorer(load_model(model_path)).eval()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    store.engines.mkdir(parents=True, exist_ok=True)
    export_onnx(scorer, tmp, meta["width"])
    probe = np.random.default_rng(0).normal(scale=0.3, size=(256, meta["width"])).astype(np.float32)
    validate_engine(OnnxRuntimeEngine.load(tmp), scorer, probe)
    os.replace(tmp, path)
    atomic_write_bytes(sidecar, sha256_of(path).encode())
    return path


@flow(name="score-new-recordings", log_prints=True)
def score_new_recordings(inbox: str, store: str = ".beatflow", fs: float | None = None, lead: int = 0) -> dict:
    """Score every new recording in ``inbox`` and move it to ``inbox/done`` or ``inbox/failed``."""
    log = get_run_logger()
    st = Store(store)
    model_path, meta = st.latest_model()
    engine_path = cached_onnx_engine(st, model_path, meta)
    items = list_inbox(inbox)
    log.info("%d new recording(s) in %s; model %s", len(items), inbox, meta["id"])
    done, failed = str(Path(inbox) / "done"), str(Path(inbox) / "failed")
    futures = score_inbox_item.map([str(p) for p in items], unmapped(str(st.root)), unmapped(str(engine_path)),
                                   unmapped(meta), unmapped(fs), unmapped(lead), unmapped(done), unmapped(failed))
    results = [f.result() for f in futures]
    if results:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(results, key="scored-recordings", description="recordings scored by this run")
    return {"model": meta["id"], "processed": results}
