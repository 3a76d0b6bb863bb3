"""Tasks of the scheduled scoring flow: score one inbox recording with the latest trained model."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from beatflow.errors import BeatflowError
from beatflow.io.sources import open_second_lead, open_source
from beatflow.score.rule import score_recording
from beatflow.io.store import AlreadyScored, Claim, Store, claim_item, describe_scoring


@functools.lru_cache(maxsize=4)
def _engine(path: str):
    from beatflow.engine.cache import load_engine

    return load_engine(path, threads=1)


@task(name="score-recording", cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=2)
def score_inbox_item(item: str, store: str, engine_path: str, meta: dict, fs: float | None, lead: int | str,
                     done: str, failed: str, column: str | None = None, confirm_lead: int | str | None = None,
                     confirm_column: str | None = None) -> dict | None:
    """Claim one file or WFDB record of the inbox, score it, append its beats to the store, move it away.

    ``column``: of a CSV/Parquet file with several. A second lead checks the beats
    (:mod:`beatflow.detect.leads`): ``confirm_lead`` for WFDB records and EDF files, ``confirm_column`` for
    CSV/Parquet files; an item without it fails. Bad input goes to ``failed/`` with a ``.reason.txt``; it never
    stops the other recordings. Content scored before (the same sha256) is a ``duplicate``: no rows,
    moved to ``done/`` with the reason.

    Returns
    -------
    dict or None
        ``item``, ``status`` (``done``, ``failed`` or ``duplicate``), ``reason``, ``beats``,
        ``flagged``, ``sha256``, ``moved_to``; None where another scorer took the item first (or an
        interrupt gave it back to the inbox).
    """
    log = get_run_logger()
    claim = claim_item(Path(item))
    if claim is None:
        log.info("%s: taken by another scorer; skipped", Path(item).name)
        return None
    try:
        outcome = _score_claimed(claim, Store(store), engine_path, meta,
                                 dict(fs=fs, lead=lead, column=column, confirm_lead=confirm_lead,
                                      confirm_column=confirm_column))
        moved = claim.finish(failed if outcome["status"] == "failed" else done, reason=outcome["reason"] or None)
    except BaseException:  # an interrupt or an unexpected error: the item goes back to the inbox (a retry
        claim.release()  # or the next run claims it again)
        raise
    if moved is None:  # (released by an interrupt meanwhile: back in the inbox)
        return None
    log.info("%s: %s, %d beats, %d flagged%s", claim.name, outcome["status"], outcome["beats"], outcome["flagged"],
             f" ({outcome['reason']})" if outcome["reason"] else "")
    return {**outcome, "moved_to": str(moved)}


def _score_claimed(claim: Claim, store: Store, engine_path: str, meta: dict, read: dict) -> dict:
    """Status, reason, beats and flagged beats of a claimed item; its beats are in the store if done."""
    sha = claim.sha256()
    out = {"item": claim.name, "status": "done", "reason": "", "beats": 0, "flagged": 0, "sha256": sha}
    earlier = store.scoring(sha)
    if earlier is not None:  # (cheap: no scoring for content scored before)
        return {**out, "status": "duplicate", "reason": describe_scoring(earlier)}
    try:
        table = _score_item(claim.item, engine_path, meta, **read)
        store.append_results(sha, table, about={"item": claim.name, "model": meta["id"]})
    except AlreadyScored as e:  # (another scorer, on the same content under another name, came first)
        return {**out, "status": "duplicate", "reason": str(e)}
    except BeatflowError as e:
        return {**out, "status": "failed", "reason": str(e)}
    return {**out, "beats": len(table), "flagged": int(table["flagged"].sum())}


def _score_item(p: Path, engine_path: str, meta: dict, fs, lead, column, confirm_lead, confirm_column):
    """The beats of every recording of one item, as one table (a ``recording`` column names them)."""
    import pandas as pd

    src = open_source(p, fs=fs, lead=lead, column=column)
    second = open_second_lead(src, p, fs, lead=lead, column=column,
                              confirm_lead=confirm_lead if src.kind in ("wfdb", "edf") else None,
                              confirm_column=confirm_column if src.kind in ("csv", "parquet") else None)
    engine = _engine(engine_path)
    tables = []
    for ri, rec in enumerate(src.recordings):
        specs = [sp for sp in src.plan(1) if sp.recording == ri]
        x = np.concatenate([src.read(sp) for sp in specs])
        x2 = np.concatenate([second.read(sp) for sp in specs]) if second is not None else None
        table = score_recording(x, rec.fs, engine.infer, meta["scale"], meta["threshold"], meta["width"],
                                name=rec.name, second=x2)
        tables.append(table.assign(recording=rec.name))
    return pd.concat(tables, ignore_index=True) if len(tables) > 1 else tables[0]
