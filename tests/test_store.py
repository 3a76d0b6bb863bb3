import json
import multiprocessing as mp

import numpy as np
import pandas as pd
import pytest

from beatflow.store import Store, StoreError, atomic_write_bytes, list_inbox, move_item


def _table(n, seed):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"beat": np.arange(n), "start": rng.integers(0, 10**6, n), "score": rng.random(n),
                         "flagged": rng.random(n) > 0.9})


def _writer(root, k):
    st = Store(root)
    for j in range(10):
        st.append_results(f"rec{j % 3}", _table(100, 100 * k + j))


def test_concurrent_writers_lose_no_rows(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), k)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    df = Store(tmp_path).read_results()
    assert len(df) == 3 * 10 * 100
    assert sorted(df["recording"].astype(str).unique()) == ["rec0", "rec1", "rec2"]


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    import os

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        Store(tmp_path).append_results("r", _table(10, 0))
    monkeypatch.undo()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert Store(tmp_path).read_results().empty


def test_model_registry_checks_the_hash(tmp_path):
    model = tmp_path / "m.pt"
    model.write_bytes(b"weights-1")
    st = Store(tmp_path / "store")
    with pytest.raises(StoreError, match="no trained model"):
        st.latest_model()
    mid = st.register_model(model, {"scale": 2.0})
    path, meta = st.latest_model()
    assert meta["id"] == mid and meta["scale"] == 2.0 and path.read_bytes() == b"weights-1"
    path.write_bytes(b"tampered")
    with pytest.raises(StoreError, match="sha256 does not match"):
        st.latest_model()


def test_inbox_listing_and_moves(tmp_path):
    (tmp_path / "a.csv").write_text("x\n1\n")
    for ext in ("hea", "dat", "atr"):
        (tmp_path / f"100.{ext}").write_text("")
    (tmp_path / "notes.txt").write_text("")
    items = list_inbox(tmp_path)
    assert [p.name for p in items] == ["100.hea", "a.csv"]
    move_item(items[0], tmp_path / "failed", reason="bad record")
    assert sorted(p.name for p in (tmp_path / "failed").iterdir()) == ["100.atr", "100.dat", "100.hea",
                                                                      "100.hea.reason.txt"]
    assert (tmp_path / "failed" / "100.hea.reason.txt").read_text() == "bad record\n"
    atomic_write_bytes(tmp_path / "x" / "y.bin", b"1")
    assert (tmp_path / "x" / "y.bin").read_bytes() == b"1"
