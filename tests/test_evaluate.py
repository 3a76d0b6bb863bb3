"""``beatflow evaluate``: record handling, AAMI classes, metrics structure, detection on real records."""
import json

import numpy as np
import pytest

from beatflow.score import evaluate as E
from beatflow.cli import main
from beatflow.errors import InputError


def test_aami_classes():
    assert [E.aami_class(c) for c in "NLRej"] == ["N"] * 5
    assert [E.aami_class(c) for c in "AaJS"] == ["S"] * 4
    assert [E.aami_class(c) for c in "VE"] == ["V"] * 2
    assert E.aami_class("F") == "F"
    assert [E.aami_class(c) for c in "/fQ"] == ["Q"] * 3
    for non_beat in "+~|x![]\"":
        assert E.aami_class(non_beat) is None
    assert set(E.BEAT_SYMBOLS) == set("NLRBAaJSVrFejnE/fQ?")


def test_anomaly_metrics_rank_each_class_against_n():
    labels = np.array(["N"] * 6 + ["V", "V", "S", "F", "Q", ""])
    scores = np.array([0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.9, 0.8, 0.25, 0.05, 5.0, 5.0])
    m = E.anomaly_metrics(scores, labels)
    assert m["auc_v"] == 1.0 and m["prauc_v"] == 1.0
    assert m["auc_s"] == pytest.approx(4 / 6)
    assert m["auc_f"] == 0.0
    assert m["counts"] == {"N": 6, "S": 1, "V": 2, "F": 1, "Q": 1}


def test_vf_episodes_and_excluded_detections():
    rec = E.Record("x", 100.0, np.zeros(2000, np.float32), np.array([100, 500, 800, 1200, 1500]),
                   np.array(["N", "[", "!", "]", "N"]))
    assert rec.vf_episodes() == [(500, 1200)]
    peaks = np.array([101, 600, 700, 1000, 1499])
    assert E.detection_of(peaks, rec).fp == 3
    d = E.detection_of(peaks, rec, exclude_vf=True)
    assert (d.tp, d.fp, d.fn) == (2, 0, 0)


def test_overlapping_records_are_refused(mitdb, capsys):
    rc = main(["evaluate", "--train", str(mitdb), "--test", str(mitdb), "--train-records", "101,106",
               "--test-records", "106,119"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "overlap" in err and "106" in err
    with pytest.raises(InputError, match="overlap"):
        E.check_disjoint(["101"], ["101"])
    rc = main(["evaluate", "--train", str(mitdb), "--test", str(mitdb)])  # the same folder, all records
    assert rc == 2


def test_bad_inputs_are_one_line_errors(mitdb, tmp_path, capsys):
    for args in (["--train", str(tmp_path), "--test", str(mitdb)],  # no records
                 ["--train", str(tmp_path / "nope"), "--test", str(mitdb)],
                 ["--train", str(mitdb), "--train-records", "999", "--test", str(mitdb), "--test-records", "101"],
                 ["--train", str(mitdb), "--train-records", "106", "--test", str(mitdb), "--test-records", "101",
                  "--lead", "5"],
                 ["--train", str(mitdb), "--train-records", "106", "--test", str(mitdb), "--test-records", "101",
                  "--confirm-lead", "0"],  # the same lead as --lead
                 ["--train", str(mitdb), "--train-records", "106", "--test", str(mitdb), "--test-records", "101",
                  "--confirm-lead", "2"]):  # MIT-BIH records have two leads
        assert main(["evaluate", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("beatflow: error:") and "\n" not in err


def test_metrics_json_structure(mitdb, tmp_path, capsys):
    out = tmp_path / "m.json"
    rc = main(["evaluate", "--train", str(mitdb), "--train-records", "106", "--test", str(mitdb),
               "--test-records", "208", "--max-seconds", "300", "--epochs", "2", "--out", str(out), "--quiet"])
    assert rc == 0
    assert "V-vs-N" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["records"] == {"train": ["106"], "test": ["208"]}
    det = res["detection"]
    for k in ("se", "ppv", "f1", "per_record", "s_per_record", "excluding_vf"):
        assert k in det
    assert set(det["per_record"]) == {"208"} and det["se"] > 0.99 and det["ppv"] > 0.99
    assert 0 <= det["jitter_ms"] < 30 and 0 < det["jf"] <= det["f1"]
    cls = res["classes"]  # the assigned classes against the annotations (de Chazal's gross Se and +P)
    assert set(cls) == {"N", "S", "V", "F", "Q"}
    assert cls["V"]["n"] == res["anomaly"]["counts"]["V"] and cls["V"]["se"] > 0.5 and cls["V"]["ppv"] > 0.5
    assert cls["N"]["se"] > 0.9 and cls["F"]["assigned"] == 0 and cls["F"]["se"] in (0, None)
    for k in ("auc_v", "auc_s", "auc_f", "prauc_v", "counts"):
        assert k in res["anomaly"]
    assert res["anomaly"]["counts"]["V"] > 50 and 0.5 < res["anomaly"]["auc_v"] <= 1.0
    assert res["anomaly"]["auc_s"] is None  # no S beats in these 300 s: NaN -> null
    flagged = res["anomaly"]["flagged"]  # the beats the pipeline's threshold flags, against the classes
    assert 0 < flagged["flagged"] < res["anomaly"]["counts"]["N"] + res["anomaly"]["counts"]["V"]
    assert 0 < flagged["v_recall"] <= 1 and 0 < flagged["v_precision"] <= 1 and 0 <= flagged["n_flagged"] < 0.05
    assert res["anomaly_all_beats"]["counts"]["V"] >= res["anomaly"]["counts"]["V"]
    assert set(res["baselines"]) == {"isolation_forest", "ecod"}
    for b in res["baselines"].values():
        assert {"auc_v", "auc_s", "auc_f", "prauc_v"} <= set(b)
    assert {"neurokit2", "xqrs"} <= set(res["peers"])
    for p in res["peers"].values():
        assert {"se", "ppv", "f1", "per_record", "s_per_record"} <= set(p)
    assert res["lead"] == 0 and res["training"]["epochs"] == 2


def test_detection_on_a_whole_record(mitdb):
    rec = E.load_record(str(mitdb / "208"), 0)  # PVCs, fusion beats, couplets; 2955 beats
    rb = E.record_beats(rec)
    d = E.detection_of(rb.peaks, rec)
    assert d.se > 0.995 and d.ppv > 0.998, d.to_dict()
    assert (rb.label == "V").sum() > 900 and (rb.label == "F").sum() > 300


def test_confirm_lead_on_a_whole_record(mitdb, tmp_path, capsys):
    """Record 207 with lead 1 checking lead 0 (beatflow.detect.leads): no reference beat lost, fewer false
    ones (flutter waves); the CLI reports the lead and the rules' parameters."""
    one = E.load_record(str(mitdb / "207"), 0)
    two = E.load_record(str(mitdb / "207"), 0, second=1)
    assert one.second is None and two.second.shape == two.signal.shape
    np.testing.assert_array_equal(two.signal, one.signal)
    a, b = E.detection_of(E.record_beats(one).peaks, one), E.detection_of(E.record_beats(two).peaks, two)
    assert b.tp >= a.tp and b.fn <= a.fn and b.fp <= a.fp - 15, (a.to_dict(), b.to_dict())
    out = tmp_path / "m.json"
    rc = main(["evaluate", "--train", str(mitdb), "--train-records", "106", "--test", str(mitdb),
               "--test-records", "207", "--max-seconds", "600", "--epochs", "1", "--confirm-lead", "1",
               "--no-peers", "--no-baselines", "--out", str(out), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["confirm_lead"]["lead"] == 1 and res["confirm_lead"]["params"]["weak_ratio"] == 0.8
