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
