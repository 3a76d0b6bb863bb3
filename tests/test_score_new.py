"""The scheduled scoring flow: inbox → results store with the latest model; bad files → failed/."""
import json
import shutil

import numpy as np
import pytest

from beatflow.store import Store


@pytest.fixture(scope="module")
def trained_store(tmp_path_factory):
    """A store whose latest model was trained (briefly) on synthetic beats at 250 Hz."""
    from beatflow.beats import beats_from_peaks, dominant_beat, embed, prune_mask, residual_rows
    from beatflow.model import save_model, score_beats, train_vae
    from beatflow.params import SegmentParams
    from beatflow.scoring import robust_threshold
    from beatflow.segment import detect_peaks
    from beatflow.synth import synthesize_ecg

    root = tmp_path_factory.mktemp("store")
    ecg = synthesize_ecg(hours=0.2, fs=250.0, seed=11)
    s = SegmentParams().samples(250.0)
    peak, start, length = beats_from_peaks(detect_peaks(ecg.signal, s), s, len(ecg.signal))
    kept = prune_mask(length, s.lower, s.upper)
    rows, p2p = embed(ecg.signal, start[kept], length[kept], s.width, baseline_samples=s.pre // 2)
    scale = float(np.median(p2p))
    x = residual_rows(rows / scale, dominant_beat(rows / scale))  # what the pipeline trains on
    res = train_vae(x, epochs=2, batch_size=256)
    score, _ = score_beats(res.model, x)
    save_model(res.model, root / "model.pt")
    Store(root).register_model(root / "model.pt", {"scale": scale, "width": s.width, "fs": 250.0,
                                                    "threshold": robust_threshold(score)})
    return root


def test_score_new_recordings(prefect_server, trained_store, tmp_path, mitdb):
    from beatflow.synth import synthesize_ecg
    from flows.score_new import score_new_recordings

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    x = synthesize_ecg(hours=0.05, fs=250.0, seed=2).signal
    (inbox / "good.csv").write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")
    (inbox / "bad.csv").write_text("heartbeats\n0.1\noops\n")
    for ext in ("hea", "dat"):
        shutil.copy(mitdb / f"119.{ext}", inbox)  # 360 Hz: the 250 Hz model refuses it
    res = score_new_recordings(inbox=str(inbox), store=str(trained_store))
    status = {r["item"]: r["status"] for r in res["processed"]}
    assert status == {"good.csv": "done", "bad.csv": "failed", "119.hea": "failed"}
    assert sorted(p.name for p in (inbox / "done").iterdir()) == ["good.csv"]
    reason = (inbox / "failed" / "bad.csv.reason.txt").read_text()
    assert "line 3: cannot parse 'oops'" in reason
    assert "model was trained on 256" in (inbox / "failed" / "119.hea.reason.txt").read_text()
    assert not list(inbox.glob("*.csv")) and not list(inbox.glob("119.*"))
    df = Store(trained_store).read_results()
    good = [r for r in res["processed"] if r["item"] == "good.csv"][0]
    assert len(df) == good["beats"] > 200 and set(df["recording"].astype(str)) == {"good"}
    # a second run finds nothing new and reuses the cached engine
    engines = sorted(p.name for p in Store(trained_store).engines.iterdir())
    again = score_new_recordings(inbox=str(inbox), store=str(trained_store))
    assert again["processed"] == [] and sorted(p.name for p in Store(trained_store).engines.iterdir()) == engines


def test_score_new_recordings_with_a_second_lead(prefect_server, trained_store, tmp_path):
    """``column`` and ``confirm_column``: a two-column CSV is scored on its first lead with the beats
    the second lead confirms (beatflow.leads); a file without that column goes to failed/."""
    import sys
    from pathlib import Path

    from beatflow.leads import second_lead_peaks
    from beatflow.params import SegmentParams
    from beatflow.segment import detect_peaks
    from flows.score_new import score_new_recordings

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
