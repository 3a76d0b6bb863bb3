import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from beatflow.io import store as store_module
from beatflow.io.store import (AlreadyScored, Store, StoreError, atomic_write_bytes, claim_item, item_sha256, list_inbox,
                            move_item, release_claims, release_dead_claims)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_claims_left():
    """Each test starts with no claim of this process (release_claims() gives back all of them)."""
    yield
    release_claims()
    store_module._CLAIMS.clear()


def _table(n, seed, recording="r"):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"beat": np.arange(n), "recording": recording, "start": rng.integers(0, 10**6, n),
                         "score": rng.random(n), "flagged": rng.random(n) > 0.9})


def _sha(*key) -> str:
    import hashlib

    return hashlib.sha256(repr(key).encode()).hexdigest()


def _writer(root, k):
    st = Store(root)
    for j in range(10):
        st.append_results(_sha(k, j), _table(100, 100 * k + j, f"rec{j % 3}"))


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
    assert set(df.groupby("sha256").size()) == {100} and df["sha256"].nunique() == 30


def _same_content_writer(root, k, go):
    go.wait(30)
    try:
        Store(root).append_results(_sha("same"), _table(100, k))
    except AlreadyScored:
        sys.exit(3)


def test_writers_racing_on_one_content_write_it_once(tmp_path):
    """Two scorers of identical content in two files: one writes its rows, the others learn it is a duplicate."""
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_same_content_writer, args=(str(tmp_path), k, go)) for k in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
    assert sorted(p.exitcode for p in procs) == [0, 3, 3, 3]
    df = Store(tmp_path).read_results()
    assert len(df) == 100 and set(df["sha256"]) == {_sha("same")}
    with pytest.raises(AlreadyScored, match=r"same content \(sha256 [0-9a-f]{12}\) as .* no rows appended"):
        Store(tmp_path).append_results(_sha("same"), _table(5, 0))


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", boom)
    with pytest.raises(KeyboardInterrupt):
        Store(tmp_path).append_results(_sha(0), _table(10, 0))
    monkeypatch.undo()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert Store(tmp_path).read_results().empty
    assert Store(tmp_path).scoring(_sha(0)) is None  # (and the content is not taken for scored)


def test_results_carry_name_and_content_hash(tmp_path):
    """Two recordings of one name keep their own rows (the hash tells them apart); older stores' rows are read."""
    st = Store(tmp_path)
    st.append_results(_sha(1), _table(7, 1, "a"), about={"item": "a.csv", "model": "m1"})
    st.append_results(_sha(2), _table(5, 2, "a"), about={"item": "a.csv", "model": "m1"})
    legacy = tmp_path / "results" / "recording=old" / "part-1.parquet"
    legacy.parent.mkdir(parents=True)
    _table(3, 3).drop(columns=["recording"]).to_parquet(legacy)
    df = st.read_results()
    assert len(df) == 15 and set(df["recording"].astype(str)) == {"a", "old"}
    sizes = df[df["recording"] == "a"].groupby("sha256").size().to_dict()
    assert sizes == {_sha(1): 7, _sha(2): 5}
    assert df[df["recording"] == "old"]["sha256"].isna().all()
    earlier = st.scoring(_sha(1))
    assert earlier["item"] == "a.csv" and earlier["model"] == "m1" and earlier["recordings"] == ["a"]
    assert st.scoring(_sha(3)) is None
    with pytest.raises(ValueError, match="not a sha256"):
        st.append_results("../../x", _table(1, 0))


def _registered(tmp_path) -> Store:
    model = tmp_path / "m.pt"
    model.write_bytes(b"weights-1")
    st = Store(tmp_path / "store")
    st.register_model(model, {"scale": 2.0, "width": 64, "threshold": 1.5})
    return st


def test_model_registry_checks_the_hash(tmp_path):
    st = Store(tmp_path / "store")
    with pytest.raises(StoreError, match="no trained model"):
        st.latest_model()
    st = _registered(tmp_path)
    path, meta = st.latest_model()
    assert meta["scale"] == 2.0 and path.read_bytes() == b"weights-1"
    assert meta["id"] == json.loads((st.models / "latest.json").read_text())["id"]
    path.write_bytes(b"tampered")
    with pytest.raises(StoreError, match="sha256 does not match"):
        st.latest_model()


@pytest.mark.parametrize("breakage, message", [
    (lambda st, mid: (st.models / "latest.json").write_text("{not json"), "latest.json: unreadable or not JSON"),
    (lambda st, mid: (st.models / "latest.json").write_text("[1, 2]"), "latest.json: garbled"),
    (lambda st, mid: (st.models / "latest.json").write_text('{"id": "x"}'), r"latest.json: garbled \(no sha256\)"),
    (lambda st, mid: (st.models / "latest.json").write_text('{"id": "../..", "sha256": "0"}'), "garbled"),
    (lambda st, mid: (st.models / "latest.json").write_bytes(b"\xff\xfe"), "latest.json: unreadable"),
    (lambda st, mid: (st.models / mid / "model.pt").unlink(), "model file missing"),
    (lambda st, mid: (st.models / mid / "model.json").unlink(), "model.json: missing"),
    (lambda st, mid: (st.models / mid / "model.json").write_text("{"), "model.json: unreadable or not JSON"),
    (lambda st, mid: (st.models / mid / "model.json").write_text('{"scale": 1}'), r"model.json: garbled \(no width"),
    (lambda st, mid: (st.models / mid / "model.json").write_text(
        '{"scale": 1, "width": 2, "threshold": 3, "sha256": "beef"}'), "model.json: its sha256 does not match"),
])
def test_broken_stores_are_one_line_store_errors(tmp_path, breakage, message):
    st = _registered(tmp_path)
    breakage(st, json.loads((st.models / "latest.json").read_text())["id"])
    with pytest.raises(StoreError, match=message) as e:
        st.latest_model()
    assert "\n" not in str(e.value)


def test_checking_the_store_imports_no_torch(tmp_path):
    """Store.latest_model is the CLI's cheap check before a flow starts: no PyTorch, no Prefect."""
    st = _registered(tmp_path)
    code = ("import sys; from beatflow.io.store import Store; Store(sys.argv[1]).latest_model(); "
            "print(sorted(m for m in ('torch', 'prefect', 'pyarrow') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(st.root)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def _record(folder: Path, stem="100", text="a"):
    for ext in ("hea", "dat", "atr"):
        (folder / f"{stem}.{ext}").write_text(f"{stem}.{ext} {text}\n")


def test_inbox_listing_and_moves(tmp_path):
    (tmp_path / "a.csv").write_text("x\n1\n")
    _record(tmp_path)
    (tmp_path / "100.csv").write_text("x\n2\n")  # (an item of its own, no part of record 100)
    (tmp_path / "notes.txt").write_text("")
    items = list_inbox(tmp_path)
    assert [p.name for p in items] == ["100.csv", "100.hea", "a.csv"]
    moved = move_item(items[1], tmp_path / "failed", reason="bad record")
    assert moved == tmp_path / "failed" / "100.hea"
    assert sorted(p.name for p in (tmp_path / "failed").iterdir()) == ["100.atr", "100.dat", "100.hea",
                                                                      "100.hea.reason.txt"]
    assert (tmp_path / "failed" / "100.hea.reason.txt").read_text() == "bad record\n"
    assert (tmp_path / "100.csv").exists() and [p.name for p in list_inbox(tmp_path)] == ["100.csv", "a.csv"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # (no temporary left)
    atomic_write_bytes(tmp_path / "x" / "y.bin", b"1")
    assert (tmp_path / "x" / "y.bin").read_bytes() == b"1"


def test_moves_never_overwrite(tmp_path):
    inbox, done = tmp_path / "inbox", tmp_path / "inbox" / "done"
    inbox.mkdir()
    contents = ["x\n1\n", "x\n2\n", "x\n1\n"]  # (the third: the first one's content again)
    places, shas = [], []
    for text in contents:
        (inbox / "a.csv").write_text(text)
        shas.append(item_sha256([inbox / "a.csv"]))
        places.append(move_item(inbox / "a.csv", done, reason=f"why {len(places)}"))
    assert places == [done / "a.csv", done / shas[1][:12] / "a.csv", done / shas[0][:12] / "a.csv"]
    assert [p.read_text() for p in places] == contents
    assert [p.with_name("a.csv.reason.txt").read_text() for p in places] == ["why 0\n", "why 1\n", "why 2\n"]
    (inbox / "a.csv").write_text(contents[0])  # (a third time: the next free subfolder)
    assert move_item(inbox / "a.csv", done) == done / f"{shas[0][:12]}-2" / "a.csv"
    for text in ("one", "two"):  # a WFDB record of a name taken: the whole record goes to one subfolder
        _record(inbox, text=text)
        moved = move_item(inbox / "100.hea", done)
        assert sorted(p.name for p in moved.parent.iterdir() if p.stem == "100") == ["100.atr", "100.dat", "100.hea"]
        assert all(p.read_text().endswith(f"{text}\n") for p in moved.parent.glob("100.*"))
    assert (done / "100.dat").read_text() == "100.dat one\n"
    assert list_inbox(inbox) == []


def test_identical_content_has_one_hash(tmp_path):
    (tmp_path / "a.csv").write_text("x\n1\n")
    (tmp_path / "b.csv").write_text("x\n1\n")
    assert item_sha256([tmp_path / "a.csv"]) == item_sha256([tmp_path / "b.csv"])
    _record(tmp_path, "100")
    sha = item_sha256(store_module.companions(tmp_path / "100.hea"))
    (tmp_path / "100.atr").write_text("other\n")  # (a companion is part of the content)
    assert item_sha256(store_module.companions(tmp_path / "100.hea")) != sha


def test_an_item_is_claimed_once(tmp_path):
    (tmp_path / "a.csv").write_text("x\n1\n")
    _record(tmp_path)
    (tmp_path / "100.csv").write_text("x\n2\n")
    items = list_inbox(tmp_path)
    claim = claim_item(tmp_path / "100.hea")
    assert claim.item.exists() and claim.item.parent.parent == tmp_path / "processing"
    assert sorted(p.name for p in claim.folder.iterdir()) == [".owner.json", "100.atr", "100.dat", "100.hea"]
    owner = json.loads((claim.folder / ".owner.json").read_text())
    assert owner["pid"] == os.getpid() and owner["item"] == "100.hea" and owner["started"] > 0 and owner["host"]
    assert claim_item(tmp_path / "100.hea") is None  # (listed before the claim: skipped)
    (tmp_path / "a.csv").rename(tmp_path / "elsewhere")  # (taken by another scorer after the listing)
    assert claim_item(items[2]) is None
    assert [p.name for p in list_inbox(tmp_path)] == ["100.csv"]
    assert [p.name for p in (tmp_path / "processing").iterdir()] == [claim.folder.name]
    done = claim.finish(tmp_path / "done")
    assert done == tmp_path / "done" / "100.hea" and not any((tmp_path / "processing").iterdir())
    assert claim.release() is None and claim.finish(tmp_path / "done") is None  # (once)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _set_owner(claim, **changes):
    path = claim.folder / ".owner.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_claims_of_dead_scorers_are_released(tmp_path):
    inbox = tmp_path
    for name in ("dead.csv", "reused.csv", "live.csv", "remote.csv"):
        (inbox / name).write_text(f"x\n{name}\n")
    _record(inbox)
    # a scorer that claimed two items and died (killed: no clean-up)
    code = ("import os, sys; from beatflow.io.store import claim_item; "
            "[claim_item(p) for p in sys.argv[1:]]; os._exit(0)")
    r = subprocess.run([sys.executable, "-c", code, str(inbox / "dead.csv"), str(inbox / "100.hea")],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 0 and len(list((inbox / "processing").iterdir())) == 2
    reused = claim_item(inbox / "reused.csv")  # owned by a process that has this one's pid, but started earlier
    _set_owner(reused, started=json.loads((reused.folder / ".owner.json").read_text())["started"] - 100)
    live = claim_item(inbox / "live.csv")
    remote = claim_item(inbox / "remote.csv")
    _set_owner(remote, host="another-host", pid=_dead_pid())
    assert [p.name for p in list_inbox(inbox)] == []
    back = release_dead_claims(inbox)
    assert sorted(p.name for p in back) == ["100.hea", "dead.csv", "reused.csv"]
    assert [p.name for p in list_inbox(inbox)] == ["100.hea", "dead.csv", "reused.csv"]
    assert sorted(p.name for p in inbox.glob("100.*")) == ["100.atr", "100.dat", "100.hea"]
    assert sorted(p.name for p in (inbox / "processing").iterdir()) == sorted([live.folder.name, remote.folder.name])
    _set_owner(live, pid=_dead_pid())
    assert [p.name for p in release_dead_claims(inbox)] == ["live.csv"] and release_dead_claims(inbox) == []
    assert live.finish(inbox / "done") is None  # (it was released: not finished as well)


def test_a_finish_cut_short_is_not_undone(tmp_path):
    """A scorer killed while it moved its item to done/ (every file placed, the item's old name removed):
    the release does not bring the rest back to the inbox as a broken record."""
    _record(tmp_path)
    claim = claim_item(tmp_path / "100.hea")
    (tmp_path / "done").mkdir()
    for p in claim.folder.glob("100.*"):
        os.link(p, tmp_path / "done" / p.name)
    claim.item.unlink()
    _set_owner(claim, pid=_dead_pid())
    assert release_dead_claims(tmp_path) == [] and list_inbox(tmp_path) == []
    assert not list(tmp_path.glob("100.*")) and not any((tmp_path / "processing").iterdir())
    assert sorted(p.name for p in (tmp_path / "done").iterdir()) == ["100.atr", "100.dat", "100.hea"]


def test_release_claims_gives_back_this_process_claims(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for inbox in (a, b):
        inbox.mkdir()
        (inbox / "x.csv").write_text("x\n1\n")
        _record(inbox)
    claims = [claim_item(inbox / name) for inbox in (a, b) for name in ("x.csv", "100.hea")]
    assert all(claims) and list_inbox(a) == list_inbox(b) == []
    assert sorted(p.name for p in release_claims(a)) == ["100.hea", "x.csv"]
    assert [p.name for p in list_inbox(a)] == ["100.hea", "x.csv"] and list_inbox(b) == []
    assert sorted(p.name for p in a.glob("100.*")) == ["100.atr", "100.dat", "100.hea"]
    assert sorted(p.name for p in release_claims()) == ["100.hea", "x.csv"] and release_claims() == []
    assert [p.name for p in list_inbox(b)] == ["100.hea", "x.csv"]
    assert not any((a / "processing").iterdir()) and not any((b / "processing").iterdir())
    assert claims[0].finish(a / "done") is None and not (a / "done").exists()


def test_release_claims_from_another_thread_while_items_finish(tmp_path):
    """An interrupt's release (another thread) racing the tasks that finish their items: each item ends
    up in done/ or back in the inbox, exactly once, and no claim is left."""
    names = [f"r{i:03d}.csv" for i in range(200)]
    for name in names:
        (tmp_path / name).write_text(f"x\n{name}\n")
    claims = [claim_item(tmp_path / name) for name in names]
    released = []
    t = threading.Thread(target=lambda: released.extend(release_claims()))
    t.start()
    finished = [c.finish(tmp_path / "done") for c in claims]
    t.join()
    finished = [p for p in finished if p is not None]
    in_inbox = [p.name for p in list_inbox(tmp_path)]
    in_done = sorted(p.name for p in (tmp_path / "done").rglob("*.csv")) if finished else []
    assert sorted(in_inbox + in_done) == names and sorted(p.name for p in released) == sorted(in_inbox)
    assert len(finished) == len(in_done) and not any((tmp_path / "processing").iterdir())
