import numpy as np
import pytest

import naive
from beatflow.score.metrics import match_beats, roc_auc
from beatflow.score.rule import anomaly_table, robust_threshold, write_anomaly_table


@pytest.mark.parametrize("seed", range(6))
def test_matching_is_maximal_on_random_beats(seed):
    rng = np.random.default_rng(seed)
    ref = np.sort(rng.choice(5000, 80, replace=False))
    jitter = ref + rng.integers(-25, 26, ref.size)
    det = np.sort(np.unique(np.concatenate([jitter[rng.random(ref.size) < 0.9], rng.choice(5000, 10)])))
    d, match = match_beats(det, ref, 20)
    assert d.tp == naive.match_count(det.tolist(), ref.tolist(), 20)
    assert d.tp + d.fn == ref.size and d.tp + d.fp == det.size
    ok = match >= 0
    assert (np.abs(det[match[ok]] - ref[ok]) <= 20).all()
    assert len(set(match[ok].tolist())) == ok.sum()


def test_perfect_detection():
    ref = np.arange(100, 10000, 250)
    d, _ = match_beats(ref + 3, ref, 10)
    assert d.se == 1.0 and d.ppv == 1.0 and d.f1 == 1.0


def test_auc_and_threshold():
    rng = np.random.default_rng(0)
    s = np.exp(rng.normal(size=2000))
    lab = np.zeros(2000, bool)
    s[:20] *= 1000
    lab[:20] = True
    assert roc_auc(s, lab) > 0.99
    assert np.isnan(roc_auc(s, np.zeros(2000, bool)))
    t = robust_threshold(s)
    flagged = s > t
    assert flagged[:20].all() and flagged[20:].mean() < 0.01


@pytest.mark.parametrize("seed", range(4))
def test_threshold_spread_within_recordings(seed):
    """With the scores' recordings, the spread is taken around each recording's own median (a loop
    reference); recordings whose normal beats differ in level no longer push the threshold above the
    abnormal beats, and one recording gives the threshold of no recordings."""
    rng = np.random.default_rng(seed)
    n_rec = int(rng.integers(2, 6))
    rec = rng.integers(0, n_rec, 3000)
    level = rng.uniform(-8.0, -4.0, n_rec)  # each recording's normal score level (log)
    s = np.exp(level[rec] + 0.4 * rng.normal(size=rec.size))
    s[:30] = np.exp(level.max() + 3.0)  # abnormal beats, well above every recording's normal ones
    names = np.asarray([f"r{k}" for k in range(n_rec)])[rec]
    ls = np.log(s)
    dev = [float(v - np.median(ls[rec == rec[i]])) for i, v in enumerate(ls)]  # loop reference
    want = float(np.exp(np.median(ls) + 4.0 * 1.4826 * np.median(np.abs(dev))))
    assert robust_threshold(s, recording=names) == pytest.approx(want, rel=1e-12)
    assert robust_threshold(s, recording=rec) == pytest.approx(want, rel=1e-12)
    if np.ptp(level) > 2.0:  # levels far apart: only the spread within recordings flags them
        assert (s[:30] > robust_threshold(s, recording=rec)).all()
        assert not (s[:30] > robust_threshold(s)).all()
    assert robust_threshold(s, recording=np.zeros(s.size, int)) == robust_threshold(s)
    with pytest.raises(ValueError, match="recording labels for 3000 scores"):
        robust_threshold(s, recording=rec[:-1])


def test_anomaly_table_ranks():
    t = anomaly_table([3, 5, 9], [0, 0, 1], [30, 50, 90], [20, 40, 80], [100, 110, 120], [0.1, 0.5, 0.3], 250.0,
                      0.2, ["a", "b"])
    assert t["rank"].tolist() == [3, 1, 2]
    assert t["flagged"].tolist() == [False, True, True]
    assert t["recording"].astype(str).tolist() == ["a", "a", "b"]
    assert t["time_s"].tolist() == [0.08, 0.16, 0.32]


@pytest.mark.parametrize("seed", range(3))
def test_anomaly_table_recordings_are_the_categorical_of_each_beats_name(seed):
    """The recording column (codes into the sorted distinct names) against pandas' Categorical of
    the name of each beat, names that repeat included."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    names = [str(v) for v in rng.choice(["100", "207", "a01", "x"], size=int(rng.integers(1, 6)))]
    rec = rng.integers(0, len(names), 500)
    t = anomaly_table(np.arange(500), rec, np.arange(500), np.arange(500), np.full(500, 150), rng.random(500), 250.0,
                      0.5, names)
    want = pd.Categorical(np.asarray(names, dtype=object)[rec])
    assert t["recording"].tolist() == want.tolist()
    assert t["recording"].cat.categories.tolist() == want.categories.tolist()


def test_anomaly_table_file_reads_back_the_same(tmp_path):
    """The table's Parquet file (dictionary encoding for the names only) reads back equal, dtypes and
    categorical names included, and only the names' column is dictionary-encoded."""
    import pandas as pd
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    rec = rng.integers(0, 3, 2000)
    t = anomaly_table(np.arange(2000), rec, np.arange(2000) * 7, np.arange(2000) * 7 - 3, rng.integers(60, 200, 2000),
                      rng.random(2000), 360.0, 0.9, ["b", "a", "c"])
    write_anomaly_table(t, tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet")
    pd.testing.assert_frame_equal(back, t)
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    assert any("DICTIONARY" in e for e in encodings["recording"])
    assert not any("DICTIONARY" in e for e in encodings["beat"] + encodings["rank"] + encodings["score"])


@pytest.mark.parametrize("seed", range(4))
def test_roc_auc_equals_scikit_learn_with_ties(seed):
    """The NumPy rank statistic against scikit-learn's ROC-AUC, on scores with many ties."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 3000))
    scores = rng.integers(0, 12, n).astype(np.float32) if seed % 2 else rng.normal(size=n)
    labels = rng.random(n) < rng.uniform(0.05, 0.6)
    labels[:2] = [True, False]
    assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_truth_check_scores_the_matched_truth_beats():
    """The flow's truth check: ROC-AUC over the truth beats matched to a kept beat (pairs counted by
    hand), PVCs against normal beats alone, the counts, and detection passed through."""
    from beatflow.score.metrics import truth_check

    matched = {"matched": np.array([0, -1, 2, 1, 3]), "labels": np.array([0, 1, 1, 2, 0]),
               "se": 0.8, "ppv": 1.0, "f1": 0.889}
    kept_scores = np.array([0.1, 0.9, 0.8, 0.85], np.float32)  # kept beats 0..3
    got = truth_check(matched, kept_scores)
    # abnormal (labels 1, 2) scored 0.8, 0.9 against normal 0.1, 0.85: 3 of 4 pairs in order
    assert got["auc"] == pytest.approx(0.75)
    # the PVC (0.8) against the normal beats (0.1, 0.85): 1 of 2
    assert got["auc_pvc"] == pytest.approx(0.5)
    assert (got["se"], got["ppv"], got["f1"]) == (0.8, 1.0, 0.889)
    assert (got["true_beats"], got["abnormal"], got["abnormal_scored"]) == (5, 3, 2)


@pytest.mark.parametrize("kind", ["distinct", "ties", "nan"])
def test_top_order_is_the_ranking_s_first_rows(kind):
    """``top_order(s, n)`` (a partition, then the few rows sorted) equals the whole ranking's first ``n`` rows
    (``rank_order``, the anomaly table's order: highest first, ties in row order, NaN last), n from 0 past the end."""
    from beatflow.score.rule import rank_order, top_order

    rng = np.random.default_rng({"distinct": 1, "ties": 2, "nan": 3}[kind])
    for _ in range(60):
        m = int(rng.integers(1, 4000))
        if kind == "distinct":
            s = rng.random(m).astype(np.float32)
        else:
            s = rng.integers(0, int(rng.integers(1, 40)), m).astype(np.float32)
        if kind == "nan":
            s[rng.random(m) < rng.random()] = np.nan
        for n in (0, 1, 7, 12, m // 5, m // 2, m, m + 4):
            np.testing.assert_array_equal(top_order(s, n), rank_order(s)[:n])


# --- the checks against a synthetic truth: detection outside unreadable spans, classes, quality ---

def _truth_file(path, unreadable=True):
    """100 truth beats every 200 samples (200..20000) at 250 Hz, an unreadable episode [5000, 7000)
    (the beats 5000..6800 under it), labels: 600 a PVC, 1400 an APC, 1600 an artifact, 6000 (under
    the episode) a PVC."""
    r = 200 * np.arange(1, 101)
    labels = np.zeros(100, np.int8)
    labels[[2, 6, 7, 29]] = [1, 3, 2, 1]
    extra = {}
    if unreadable:
        extra = {"unreadable": np.array([[5000, 7000]], np.int64), "unreadable_reason": np.array(["noise"]),
                 "beat_unreadable": (r >= 5000) & (r < 7000)}
    np.savez(path, r_peaks=r, labels=labels, fs=np.float64(250.0), **extra)
    return r, labels


def test_match_truth_counts_detection_outside_unreadable_spans(tmp_path):
    """Se and PPV (counted by hand) over the truth beats and peaks outside the episode widened by the
    150 ms tolerance (38 samples: [4962, 7038)); a truth without episodes counts every beat."""
    from beatflow.score.metrics import match_truth

    r, labels = _truth_file(tmp_path / "t.npz")
    inside = (r >= 5000) & (r < 7000)
    found = r[~inside & ~np.isin(r, [1000, 1200])] + 2  # two beats missed outside; 7002 lies in the guard
    peaks = np.sort(np.r_[found, 5100, 5500, 6000, 10100])  # three peaks in the noise, one false peak outside
    kept = peaks[peaks != 10100]
    got = match_truth(str(tmp_path / "t.npz"), peaks, kept, 250.0)
    # counted: 100 - 11 truth beats (5000..7000), 92 - 4 peaks (5100, 5500, 6000, 7002); 87 matched
    assert (got["excluded_beats"], got["excluded_peaks"]) == (11, 4)
    assert got["se"] == pytest.approx(87 / 89) and got["ppv"] == pytest.approx(87 / 88)
    assert "unreadable" in got["detection_scope"]
    # every truth beat is matched to the kept beats, those under the episode included (6000 to 6000)
    m = got["matched"]
    assert m.shape == (100,) and (m >= 0).sum() == 98 - 10 + 1
    assert kept[m[29]] == 6000 and got["beat_unreadable"][29] and got["beat_unreadable"].sum() == 10
    # per kept beat: the label of its truth beat (-1 for none) and whether that one is unreadable
    assert got["kept_labels"].shape == kept.shape
    np.testing.assert_array_equal(got["kept_labels"][m[[1, 2, 6, 7, 29]]], [0, 1, 3, 2, 1])
    assert (got["kept_labels"] == -1).sum() == 2  # 5100, 5500
    assert got["kept_unreadable"][m[29]] and got["kept_unreadable"].sum() == 1
    np.testing.assert_array_equal(got["unreadable"], [[5000, 7000]])
    assert got["unreadable_reason"].tolist() == ["noise"] and got["fs"] == 250.0
    # a truth of r_peaks, labels and fs alone: every beat and peak counts (6000 matches beat 6000)
    _truth_file(tmp_path / "old.npz", unreadable=False)
    old = match_truth(str(tmp_path / "old.npz"), peaks, kept, 250.0)
    assert old["se"] == pytest.approx(89 / 100) and old["ppv"] == pytest.approx(89 / 92)
    assert (old["excluded_beats"], old["excluded_peaks"]) == (0, 0) and old["unreadable"].shape == (0, 2)
    np.testing.assert_array_equal(old["matched"], m)


def test_truth_check_leaves_unreadable_beats_out_and_apcs_apart():
    """The AUCs over readable matched beats (pairs by hand): the unreadable normal beat's top score
    counts nowhere; APCs are scored on their own and in ``auc_any``."""
    from beatflow.score.metrics import truth_check

    matched = {"matched": np.array([0, 1, 2, 3, 4, 5, -1]), "labels": np.array([0, 0, 1, 3, 2, 0, 1]),
               "beat_unreadable": np.array([0, 0, 0, 0, 0, 1, 0], bool), "se": 1.0, "ppv": 1.0, "f1": 1.0,
               "unreadable": np.array([[500, 1000]]), "fs": 250.0}
    got = truth_check(matched, np.array([0.1, 0.3, 0.9, 0.2, 0.8, 5.0]))
    assert got["auc"] == 1.0 and got["auc_pvc"] == 1.0  # {0.9, 0.8} above {0.1, 0.3}
    assert got["auc_apc"] == pytest.approx(0.5)  # 0.2 against {0.1, 0.3}
    assert got["auc_any"] == pytest.approx(5 / 6)  # {0.9, 0.2, 0.8} against {0.1, 0.3}: 5 of 6 pairs
    assert (got["true_beats"], got["abnormal"], got["abnormal_scored"]) == (7, 4, 3)
    assert got["classes"] == {"N": 3, "V": 2, "S": 1, "artifact": 1}
    assert (got["unreadable_beats"], got["unreadable_episodes"], got["unreadable_s"]) == (1, 1, 2.0)
    assert "detection_scope" not in got  # (only what match_truth gave is passed on)
    matched.update(detection_scope="outside", excluded_beats=3, excluded_peaks=2)
    got = truth_check(matched, np.array([0.1, 0.3, 0.9, 0.2, 0.8, 5.0]))
    assert (got["detection_scope"], got["excluded_beats"], got["excluded_peaks"]) == ("outside", 3, 2)


def _class_case():
    """Ten truth beats (N N N V V S V artifact N S, the last S under an episode), the seventh (V) missed;
    ten kept beats, the last matched to none."""
    matched = {"matched": np.array([0, 1, 2, 3, 4, 5, -1, 6, 7, 8]),
               "labels": np.array([0, 0, 0, 1, 1, 3, 1, 2, 0, 3], np.int8),
               "beat_unreadable": np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 1], bool),
               "kept_labels": np.array([0, 0, 0, 1, 1, 3, 2, 0, 3, -1], np.int8)}
    kept_classes = np.array(["N", "N", "V", "V", "N", "S", "Q", "V", "S", "F"])
    return matched, kept_classes


def test_truth_classes_by_hand():
    from beatflow.score.metrics import truth_classes

    matched, kept_classes = _class_case()
    got = truth_classes(matched, kept_classes)
    # N: 4 readable matched (assigned N N V V), 3 assigned N (one a V): se 2/4, ppv 2/3
    assert got["N"] == {"se": 0.5, "ppv": pytest.approx(2 / 3), "n": 4}
    # V: 2 matched (the missed one counts nowhere) assigned V, N; 3 assigned V: se 1/2, ppv 1/3
    assert got["V"] == {"se": 0.5, "ppv": pytest.approx(1 / 3), "n": 2}
    assert got["S"] == {"se": 1.0, "ppv": 1.0, "n": 1}  # the S under the episode counts apart
    assert got["confusion"] == {"N": {"N": 2, "V": 2}, "S": {"S": 1}, "V": {"N": 1, "V": 1}}
    assert got["artifacts"] == {"Q": 1} and got["unreadable"] == {"S": 1} and got["unmatched"] == {"F": 1}
    assert "artifacts" in got["scope"]
    # a class nobody has, or nobody was assigned: NaN
    got = truth_classes(matched, np.array(["N"] * 10))
    assert np.isnan(got["V"]["ppv"]) and got["V"]["se"] == 0.0 and got["N"]["ppv"] == pytest.approx(4 / 7)
    none = dict(matched, labels=np.zeros(10, np.int8))
    assert np.isnan(truth_classes(none, kept_classes)["S"]["se"])


@pytest.mark.parametrize("bad", [np.array(["N"] * 9), np.array(["N"] * 11), np.array(["N"] * 9 + ["X"])])
def test_truth_classes_rejects_bad_classes(bad):
    from beatflow.score.metrics import truth_classes

    matched, _ = _class_case()
    with pytest.raises(ValueError):
        truth_classes(matched, bad)


def test_truth_quality_by_hand():
    """Three episodes (noise, lead-off, clipping) against found spans that overlap, touch and miss."""
    from beatflow.score.metrics import truth_quality

    matched = {"unreadable": np.array([[1000, 2000], [5000, 5500], [9000, 9100]]),
               "unreadable_reason": np.array(["noise", "lead_off", "clipping"]), "fs": 100.0}
    found = [[1900, 2100], [8000, 8500], [1500, 2500], [9050, 9060], [3000, 3000]]  # union: 3 spans
    got = truth_quality(matched, found)
    assert (got["episodes"], got["episodes_found"], got["spans_found"], got["spans_false"]) == (3, 2, 3, 1)
    assert got["by_reason"] == {"noise": {"episodes": 1, "found": 1}, "lead_off": {"episodes": 1, "found": 0},
                                "clipping": {"episodes": 1, "found": 1}}
    assert got["seconds_true"] == 16.0 and got["seconds_found"] == pytest.approx(15.1)
    assert got["seconds_overlap"] == pytest.approx(5.1) and got["seconds_false"] == pytest.approx(10.0)
    got = truth_quality(matched, np.zeros((0, 2), np.int64))
    assert got["episodes_found"] == 0 and got["seconds_found"] == 0.0 and got["spans_false"] == 0
    got = truth_quality({"fs": 250.0}, [[0, 250]])  # a truth without episodes
    assert got["episodes"] == 0 and got["seconds_false"] == 1.0 and got["spans_false"] == 1


@pytest.mark.parametrize("seed", range(4))
def test_spans_union_and_membership(seed):
    """merge_spans and in_spans against a boolean mask of the samples."""
    from beatflow.score.metrics import in_spans, merge_spans

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1000, 30)
    spans = np.stack([a, a + rng.integers(0, 60, 30)], axis=1)
    mask = np.zeros(1100, bool)
    for lo, hi in spans:
        mask[lo:hi] = True
    u = merge_spans(spans)
    assert np.all(u[1:, 0] > u[:-1, 1]) and np.all(u[:, 1] > u[:, 0])
    back = np.zeros(1100, bool)
    for lo, hi in u:
        back[lo:hi] = True
    np.testing.assert_array_equal(back, mask)
    np.testing.assert_array_equal(in_spans(np.arange(1100), spans), mask)
