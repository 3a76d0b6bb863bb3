"""Tasks of the scheduled scoring flow: score one inbox recording with the latest trained model."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from beatflow.errors import BeatflowError
from beatflow.reading import open_second_lead, open_source
from beatflow.scoring import score_recording
from beatflow.store import Store, move_item


@functools.lru_cache(maxsize=4)
def _engine(path: str):
    from beatflow.engines import load_engine

    return load_engine(path, threads=1)


@task(name="score-recording", cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=2)
def score_inbox_item(item: str, store: str, engine_path: str, meta: dict, fs: float | None, lead: int,
                     done: str, failed: str, column: str | None = None, confirm_lead: int | None = None,
                     confirm_column: str | None = None) -> dict:
    """Score one file or WFDB record of the inbox; append its beats to the store; move it away.

    ``column``: of a CSV/Parquet file with several. A second lead checks the beats
    (:mod:`beatflow.leads`): ``confirm_lead`` for WFDB records, ``confirm_column`` for CSV/Parquet
    files; an item without it fails. Bad input goes to ``failed/`` with a ``.reason.txt``; it never
    stops the other recordings.
    """
    log = get_run_logger()
    p = Path(item)
    try:
        src = open_source(p, fs=fs, lead=lead, column=column)
        second = open_second_lead(src, p, fs, lead=lead, column=column,
                                  confirm_lead=confirm_lead if src.kind == "wfdb" else None,
                                  confirm_column=confirm_column if src.kind in ("csv", "parquet") else None)
        engine = _engine(engine_path)
        rows = 0
        flagged = 0
        for ri, rec in enumerate(src.recordings):
            specs = [sp for sp in src.plan(1) if sp.recording == ri]
            x = np.concatenate([src.read(sp) for sp in specs])
            x2 = np.concatenate([second.read(sp) for sp in specs]) if second is not None else None
            table = score_recording(x, rec.fs, engine.infer, meta["scale"], meta["threshold"], meta["width"],
                                    name=rec.name, second=x2)
            Store(store).append_results(rec.name, table)
            rows += len(table)
            flagged += int(table["flagged"].sum())
    except BeatflowError as e:
        log.warning("%s: moved to failed/: %s", p.name, e)
        move_item(p, Path(failed), reason=str(e))
        return {"item": p.name, "status": "failed", "reason": str(e), "beats": 0, "flagged": 0}
    move_item(p, Path(done))
    log.info("%s: %d beats scored, %d flagged", p.name, rows, flagged)
    return {"item": p.name, "status": "done", "reason": "", "beats": rows, "flagged": flagged}
