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
