"""The scheduled scoring flow: inbox → results store with the latest model; bad files → failed/."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from beatflow.io.store import Store, StoreError, item_sha256

from conftest import ROOT


def _write_csv(path, seed, hours=0.02):
    from beatflow.io.synth import synthesize_ecg

    x = synthesize_ecg(hours=hours, fs=250.0, seed=seed).signal
    path.write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")


@pytest.fixture(scope="module")
def trained_store(tmp_path_factory):
    """A store whose latest model was trained (briefly) on synthetic beats at 250 Hz."""
    from beatflow.embed import embed
    from beatflow.embed.beats import beats_from_peaks, prune_mask
    from beatflow.model.train import train_vae
    from beatflow.model.vae import save_model, score_beats
    from beatflow.params import SegmentParams
    from beatflow.score.rule import model_input, robust_threshold
    from beatflow.detect import detect_peaks
    from beatflow.io.synth import synthesize_ecg

    root = tmp_path_factory.mktemp("store")
    ecg = synthesize_ecg(hours=0.2, fs=250.0, seed=11)
    s = SegmentParams().samples(250.0)
    peak, start, length = beats_from_peaks(detect_peaks(ecg.signal, s), s, len(ecg.signal))
    kept = prune_mask(length, s.lower, s.upper)
    rows, p2p = embed(ecg.signal, start[kept], length[kept], s.width, baseline_samples=s.pre // 2)
    scale = float(np.median(p2p))
    x = model_input(rows, scale)  # what the pipeline trains on
    res = train_vae(x, epochs=2, batch_size=256)
    score, _ = score_beats(res.model, x)
    save_model(res.model, root / "model.pt")
    Store(root).register_model(root / "model.pt", {"scale": scale, "width": s.width, "fs": 250.0,
                                                    "threshold": robust_threshold(score)})
    return root


def test_score_new_recordings(prefect_server, trained_store, tmp_path, mitdb):
    from beatflow.io.synth import synthesize_ecg
    from beatflow.pipeline.inbox_flow import score_new_recordings

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    x = synthesize_ecg(hours=0.05, fs=250.0, seed=2).signal
    (inbox / "good.csv").write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")
    (inbox / "bad.csv").write_text("heartbeats\n0.1\noops\n")
    for ext in ("hea", "dat"):
        shutil.copy(mitdb / f"119.{ext}", inbox)  # 360 Hz: the 250 Hz model refuses it
    sha = item_sha256([inbox / "good.csv"])
    res = score_new_recordings(inbox=str(inbox), store=str(trained_store))
    status = {r["item"]: r["status"] for r in res["processed"]}
    assert status == {"good.csv": "done", "bad.csv": "failed", "119.hea": "failed"}
    assert sorted(p.name for p in (inbox / "done").iterdir()) == ["good.csv"]
    good = [r for r in res["processed"] if r["item"] == "good.csv"][0]
    assert good["sha256"] == sha and good["moved_to"] == str(inbox / "done" / "good.csv") and good["reason"] == ""
    assert {r["item"]: r["moved_to"] for r in res["processed"]}["119.hea"] == str(inbox / "failed" / "119.hea")
    assert not any((inbox / "processing").iterdir())
    reason = (inbox / "failed" / "bad.csv.reason.txt").read_text()
    assert "line 3: cannot parse 'oops'" in reason
    assert "model was trained on 256" in (inbox / "failed" / "119.hea.reason.txt").read_text()
    assert not list(inbox.glob("*.csv")) and not list(inbox.glob("119.*"))
    df = Store(trained_store).read_results()
    assert len(df) == good["beats"] > 200 and set(df["recording"].astype(str)) == {"good"}
    assert set(df["sha256"]) == {sha}
    # a second run finds nothing new and reuses the cached engine
    engines = sorted(p.name for p in Store(trained_store).engines.iterdir())
    again = score_new_recordings(inbox=str(inbox), store=str(trained_store))
    assert again["processed"] == [] and sorted(p.name for p in Store(trained_store).engines.iterdir()) == engines


def test_score_new_recordings_with_a_second_lead(prefect_server, trained_store, tmp_path):
    """``column`` and ``confirm_column``: a two-column CSV is scored on its first lead with the beats
    the second lead confirms (beatflow.detect.leads); a file without that column goes to failed/."""
    import sys
    from pathlib import Path

    from beatflow.detect import second_lead_peaks
    from beatflow.params import SegmentParams
    from beatflow.detect import detect_peaks
    from beatflow.pipeline.inbox_flow import score_new_recordings

    sys.path.insert(0, str(Path(__file__).parent))
    from test_leads import _two_leads

    x0, x1 = _two_leads(3, 250.0, 240.0)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "two.csv").write_text("a,b\n" + "\n".join(f"{u:.5f},{v:.5f}" for u, v in zip(x0, x1)) + "\n")
    (inbox / "one.csv").write_text("a\n" + "\n".join(f"{u:.5f}" for u in x0) + "\n")
    before = len(Store(trained_store).read_results())
    res = score_new_recordings(inbox=str(inbox), store=str(trained_store), column="a", confirm_column="b")
    status = {r["item"]: r for r in res["processed"]}
    assert status["two.csv"]["status"] == "done" and status["one.csv"]["status"] == "failed"
    assert "unknown column 'b'" in (inbox / "failed" / "one.csv.reason.txt").read_text()
    import pandas as pd

    back = pd.read_csv(inbox / "done" / "two.csv", dtype=np.float32)
    a, b = back["a"].to_numpy(), back["b"].to_numpy()
    s = SegmentParams().samples(250.0)
    peaks = detect_peaks(a, s)
    want = second_lead_peaks(a, b, peaks, 250.0, s)[0]
    keep = np.isin(peaks, want)
    assert keep.sum() < len(peaks)  # (the second lead drops some of this stream's peaks)
    df = Store(trained_store).read_results()
    two = df[df["recording"].astype(str) == "two"]
    assert len(df) - before == len(two) == status["two.csv"]["beats"]
    assert np.isin(two["peak"].to_numpy(), want).all() and not np.isin(peaks[~keep], two["peak"]).any()


def test_same_content_is_scored_once(prefect_server, trained_store, tmp_path):
    """Identical content under two names, and under a name scored before: rows once, status duplicate,
    every file kept in done/; new content under a name scored before: its own rows, beside the others."""
    from beatflow.pipeline.inbox_flow import score_new_recordings

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    _write_csv(inbox / "a.csv", seed=201)
    shutil.copy(inbox / "a.csv", inbox / "b.csv")
    _write_csv(inbox / "c.csv", seed=202)
    sha_a, sha_c = item_sha256([inbox / "a.csv"]), item_sha256([inbox / "c.csv"])
    st = Store(trained_store)
    before = st.read_results()
    res = score_new_recordings(inbox=str(inbox), store=str(trained_store))
    by = {r["item"]: r for r in res["processed"]}
    assert sorted((by["a.csv"]["status"], by["b.csv"]["status"])) == ["done", "duplicate"]
    assert by["c.csv"]["status"] == "done"
    first, dup = sorted((by["a.csv"], by["b.csv"]), key=lambda r: r["status"])
    assert dup["beats"] == 0 and dup["sha256"] == first["sha256"] == sha_a
    assert f"as {first['item']} scored" in dup["reason"] and sha_a[:12] in dup["reason"]
    assert sorted(p.name for p in (inbox / "done").iterdir()) == sorted(
        ["a.csv", "b.csv", dup["item"] + ".reason.txt", "c.csv"])
    df = st.read_results()
    assert len(df) - len(before) == first["beats"] + by["c.csv"]["beats"]
    new = df[df["sha256"].isin([sha_a, sha_c])]
    assert new.groupby("sha256").size().to_dict() == {sha_a: first["beats"], sha_c: by["c.csv"]["beats"]}
    assert set(new[new["sha256"] == sha_a]["recording"]) == {Path(first["item"]).stem}

    # a later run: a.csv again, with the same content, then with new content
    shutil.copy(inbox / "done" / "a.csv", inbox / "a.csv")
    again = score_new_recordings(inbox=str(inbox), store=str(trained_store))["processed"]
    assert [(r["item"], r["status"], r["beats"]) for r in again] == [("a.csv", "duplicate", 0)]
    assert again[0]["moved_to"] == str(inbox / "done" / sha_a[:12] / "a.csv")
    assert len(st.read_results()) == len(df)
    _write_csv(inbox / "a.csv", seed=203)
    sha_new = item_sha256([inbox / "a.csv"])
    third = score_new_recordings(inbox=str(inbox), store=str(trained_store))["processed"]
    assert [(r["item"], r["status"]) for r in third] == [("a.csv", "done")]
    assert third[0]["moved_to"] == str(inbox / "done" / sha_new[:12] / "a.csv")
    df = st.read_results()
    assert len(df[df["sha256"] == sha_new]) == third[0]["beats"] > 0
    assert item_sha256([inbox / "done" / "a.csv"]) == item_sha256([inbox / "done" / "b.csv"]) == sha_a  # (kept)
    assert item_sha256([Path(third[0]["moved_to"])]) == sha_new and not list_inbox_names(inbox)


def list_inbox_names(inbox):
    from beatflow.io.store import list_inbox

    return [p.name for p in list_inbox(inbox)]


# `beatflow score`, whose flow lists the inbox only once the other command's flow is about to list it too:
# each item is then raced for by both (started together, one command would often find the inbox scored)
_SCORE_IN_STEP = """
import os, sys, time
from pathlib import Path

import beatflow.pipeline.inbox_flow as flow_module
from beatflow.cli import main

def list_in_step(inbox, _list=flow_module.list_inbox):
    gate = Path(sys.argv[1])
    (gate / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(gate.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return _list(inbox)

flow_module.list_inbox = list_in_step
sys.exit(main(sys.argv[2:]))
"""


def test_two_scorers_at_once(prefect_server, trained_store, tmp_path):
    """Two `beatflow score` commands on one inbox: both finish without error, each file is scored once."""
    inbox, gate = tmp_path / "inbox", tmp_path / "gate"
    inbox.mkdir()
    gate.mkdir()
    names = [f"rec{i}.csv" for i in range(6)]
    for i, name in enumerate(names):
        _write_csv(inbox / name, seed=100 + i)
    shas = {item_sha256([inbox / n]): n for n in names}
    before = Store(trained_store).read_results()
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _SCORE_IN_STEP, str(gate), "score", "--inbox", str(inbox),
           "--store", str(trained_store)]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(list(gate.iterdir())) == 2  # (both listed the inbox in step)
    done = sorted(p.relative_to(inbox / "done") for p in (inbox / "done").rglob("*") if p.is_file())
    assert [str(p) for p in done] == names  # (once each, and none in a subfolder as a second copy)
    assert list_inbox_names(inbox) == [] and not any((inbox / "processing").iterdir())
    assert not (inbox / "failed").exists()
    df = Store(trained_store).read_results()
    assert len(df) > len(before)
    new = df[df["sha256"].isin(list(shas))]
    for sha, name in shas.items():  # each recording's rows once: scored by one of the two
        rows = new[new["sha256"] == sha]
        assert len(rows) > 0 and set(rows["recording"]) == {name[:-4]}
        assert not rows.duplicated(["beat"]).any()


def test_a_model_that_does_not_load_is_a_store_error(trained_store, tmp_path):
    """A registered model file that matches its hash but holds a pickle that would run code is refused by
    torch.load(weights_only=True): one StoreError naming the file, and the code never runs."""
    import torch

    from beatflow.pipeline.inbox_flow import cached_engine

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "evil.pt"
    torch.save({"width": 64, "state_dict": Payload()}, evil)
    st = Store(tmp_path / "store")
    meta = {**json.loads(next(Store(trained_store).models.glob("*/model.json")).read_text())}
    st.register_model(evil, meta)
    path, meta = st.latest_model()  # (the hash matches: what was registered)
    with pytest.raises(StoreError, match=r"model.pt: the registered model does not load \(torch.load\(weights_only"
                                         r"=True\) refused it") as e:
        cached_engine(st, path, meta)
    assert "\n" not in str(e.value) and str(path) in str(e.value) and not marker.exists()
    path.write_bytes(b"not a model")  # (re-registered: a file that is no saved model at all)
    st.register_model(path, meta)
    path, meta = st.latest_model()
    with pytest.raises(StoreError, match="does not load"):
        cached_engine(st, path, meta)


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_task_gives_its_item_back(tmp_path, monkeypatch, error):
    """The task claims its item; interrupted (or failing unexpectedly: Prefect retries it) it moves the
    item back to the inbox: nothing stays claimed, nothing goes to done/ or failed/."""
    import logging

    import beatflow.pipeline.inbox as scoring

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a.csv").write_text("x\n1\n")
    seen = []

    def interrupted(p, *a, **k):
        seen.append(p)
        raise error

    monkeypatch.setattr(scoring, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(scoring, "_score_item", interrupted)
    with pytest.raises(error):
        scoring.score_inbox_item.fn(str(inbox / "a.csv"), str(tmp_path / "store"), "engine", {"id": "m"}, None, 0,
                                    str(inbox / "done"), str(inbox / "failed"))
    assert seen and seen[0].parent.parent == inbox / "processing"  # (it was scored while claimed)
    assert (inbox / "a.csv").read_text() == "x\n1\n" and not any((inbox / "processing").iterdir())
    assert not (inbox / "done").exists() and not (inbox / "failed").exists()
