"""EDF/EDF+/BDF input (beatflow.io.edf through beatflow.io.sources): values, partitions, channels by
index or label, folders, the second lead, and each bad file as one line (exit 2 through the CLI)."""
import json
import warnings

import numpy as np
import pytest

from beatflow.errors import InputError
from beatflow.io.sources import EdfSource, open_second_lead, open_source
from beatflow.params import check_fs
from conftest import run_cli
from test_score_new import trained_store  # noqa: F401 (the fixture: a store with a model trained at 250 Hz)

pyedflib = pytest.importorskip("pyedflib")
from pyedflib import highlevel  # noqa: E402

DEAD_API = "http://127.0.0.1:9/api"  # (errors found before the flow starts need no server)
SECONDS = 20
# three channels: MLII at 360 Hz in mV, V1 at 360 Hz in uV, V5 at 128 Hz in uV
LABELS, RATES, DIMS = ["MLII", "V1", "V5"], [360, 360, 128], ["mV", "uV", "uV"]
PHYS = [(-5.0, 5.0), (-5000.0, 5000.0), (-5000.0, 5000.0)]


def waves(rates=RATES, dims=DIMS, seconds=SECONDS, seed=0):
    """Random-walk signals of ``seconds`` at ``rates``, about a millivolt in size, in ``dims`` units."""
    rng = np.random.default_rng(seed)
    out = []
    for fs, dim in zip(rates, dims):
        x = np.cumsum(rng.normal(scale=0.05, size=int(seconds * fs)))
        x = 2.0 * np.tanh(x - x.mean())  # mV, within ±2
        out.append(x * (1000.0 if dim == "uV" else 1.0))
    return out


def write(path, signals=None, labels=LABELS, rates=RATES, dims=DIMS, phys=PHYS, file_type=None):
    """An EDF (``.edf``) or BDF (``.bdf``) file written by pyedflib; EDF+/BDF+ unless ``file_type``."""
    signals = waves(rates, dims) if signals is None else signals
    bdf = str(path).endswith(".bdf")
    if file_type is None:
        file_type = pyedflib.FILETYPE_BDFPLUS if bdf else pyedflib.FILETYPE_EDFPLUS
    digital = (-(1 << 23), (1 << 23) - 1) if bdf else (-32768, 32767)
    headers = [dict(label=lb, dimension=d, sample_frequency=fs, physical_min=lo, physical_max=hi,
                    digital_min=digital[0], digital_max=digital[1], transducer="", prefilter="")
               for lb, fs, d, (lo, hi) in zip(labels, rates, dims, phys)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        highlevel.write_edf(str(path), signals, headers, file_type=file_type)
    return path


def step_mv(path, k):
    """The quantisation step of channel ``k`` as written by :func:`write`, in mV."""
    lo, hi = PHYS[k]
    levels = (1 << 24) - 1 if str(path).endswith(".bdf") else 65535
    return (hi - lo) / levels * (1e-3 if DIMS[k] == "uV" else 1.0)


def read_all(src, n):
    return np.concatenate([src.read(sp) for sp in src.plan(n)])


def one_line(e, *parts):
    msg = str(e.value)
    assert "\n" not in msg and "\r" not in msg, msg
    for part in parts:
        assert str(part) in msg, (part, msg)
    return msg


def patch(path, offset, text):
    """Overwrite header bytes of ``path`` at ``offset`` with ``text`` (ASCII, space-padded fields)."""
    data = bytearray(path.read_bytes())
    data[offset : offset + len(text)] = text.encode("ascii")
    path.write_bytes(bytes(data))


def signal_field(ns, field, k):
    """Byte offset of signal ``k``'s ``field`` in a header of ``ns`` signals."""
    widths = [("label", 16), ("transducer", 80), ("dimension", 8), ("physical_min", 8), ("physical_max", 8),
              ("digital_min", 8), ("digital_max", 8), ("prefilter", 80), ("samples_per_record", 8)]
    at = 256
    for name, w in widths:
        if name == field:
            return at + k * w
        at += w * ns
    raise KeyError(field)


# ---- values, partitions, channels

@pytest.mark.parametrize("name", ["r.edf", "r.bdf"])
@pytest.mark.parametrize("plus", [True, False])
def test_values_are_what_was_written_in_mv(tmp_path, name, plus):
    bdf = name.endswith(".bdf")
    ft = None if plus else (pyedflib.FILETYPE_BDF if bdf else pyedflib.FILETYPE_EDF)
    signals = waves()
    p = write(tmp_path / name, signals, file_type=ft)
    for k in range(3):
        src = open_source(p, lead=k)
        assert isinstance(src, EdfSource) and src.kind == "edf"
        rec = src.recordings[0]
        assert (rec.name, rec.fs, rec.n_samples) == ("r", RATES[k], SECONDS * RATES[k])
        x = read_all(src, 1)
        assert x.dtype == np.float32
        want = signals[k] * (1e-3 if DIMS[k] == "uV" else 1.0)  # uV channels arrive in mV
        err = np.abs(x - want).max()
        assert err <= step_mv(p, k) + 1e-5 * np.abs(want).max(), (k, err)
        assert np.abs(x).max() > 1.0  # (millivolts, not microvolts)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 50])
def test_partitions_concatenate_to_the_whole(tmp_path, n):
    p = write(tmp_path / "r.edf")
    src = open_source(p, lead="V5")
    specs = src.plan(n)
    assert len(specs) == min(n, SECONDS * 128) and specs[0].start == 0 and specs[-1].stop == SECONDS * 128
    whole = open_source(p, lead="V5").read(src.plan(1)[0])
    np.testing.assert_array_equal(read_all(src, n), whole)


def test_channels_by_label_and_by_index(tmp_path):
    p = write(tmp_path / "r.edf")
    for lead, k in (("MLII", 0), ("mlii", 0), (" V1 ", 1), ("V5", 2), (1, 1), (2, 2)):
        src = open_source(p, lead=lead)
        assert src.channels == (k,) and src.fs == RATES[k]
        assert src.files[0].label == LABELS[k]
    np.testing.assert_array_equal(read_all(open_source(p, lead="V1"), 2), read_all(open_source(p, lead=1), 3))


def test_unknown_channel_lists_the_labels(tmp_path):
    p = write(tmp_path / "r.edf")
    with pytest.raises(InputError) as e:
        open_source(p, lead="V6")
    assert one_line(e) == f"{p}: --lead 'V6': no channel of that label (channels: 0 'MLII', 1 'V1', 2 'V5')"
    with pytest.raises(InputError) as e:
        open_source(p, lead=3)
    assert one_line(e) == f"{p}: --lead 3: no such channel (channels: 0 'MLII', 1 'V1', 2 'V5')"


def test_annotation_channels_are_never_leads(tmp_path):
    # EDF+: EDFlib leaves the annotation channel out; a plain EDF channel of that label is refused
    plus = write(tmp_path / "plus.edf")
    assert open(plus, "rb").read(256)[252:256].strip() == b"4"  # (three signals and the annotations)
    with pytest.raises(InputError) as e:
        open_source(plus, lead="EDF Annotations")
    one_line(e, "no channel of that label", "(channels: 0 'MLII', 1 'V1', 2 'V5')")
    labels = ["MLII", "EDF Annotations"]
    plain = write(tmp_path / "plain.edf", labels=labels, rates=[250, 250], dims=["mV", "mV"], phys=PHYS[:1] * 2,
                  file_type=pyedflib.FILETYPE_EDF)
    with pytest.raises(InputError) as e:
        open_source(plain, lead=1)
    assert one_line(e) == (f"{plain}: --lead 1: 'EDF Annotations' is an annotation channel, not an ECG lead "
                           f"(channels: 0 'MLII')")
    with pytest.raises(InputError):
        open_source(plain, lead="edf annotations")
    assert open_source(plain, lead=0).channels == (0,)


def test_duplicate_labels_need_an_index(tmp_path):
    p = write(tmp_path / "r.edf", labels=["ECG", "ECG", "V5"])
    with pytest.raises(InputError) as e:
        open_source(p, lead="ecg")
    assert one_line(e) == f"{p}: --lead 'ecg': 2 channels have that label (0, 1); choose one by its index"


# ---- folders

def test_a_folder_of_edf_and_bdf_files(tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    sig = {name: waves(seed=i, seconds=10 + 5 * i) for i, name in enumerate(("b", "a", "c"))}
    write(d / "b.edf", sig["b"])
    write(d / "a.bdf", sig["a"])
    write(d / "c.EDF", sig["c"])
    (d / "notes.txt").write_text("not a recording")
    src = open_source(d, lead="MLII")
    assert isinstance(src, EdfSource) and [r.name for r in src.recordings] == ["a", "b", "c"]
    assert [r.n_samples for r in src.recordings] == [360 * 15, 360 * 10, 360 * 20] and src.fs == 360
    specs = src.plan(6)
    assert {sp.recording for sp in specs} == {0, 1, 2}
    for ri, name in enumerate(("a", "b", "c")):
        x = np.concatenate([src.read(sp) for sp in specs if sp.recording == ri])
        np.testing.assert_allclose(x, sig[name][0], atol=step_mv(d / "a.edf", 0))
    # the second lead of each file: V1 (same rate); V5 is sampled at 128 Hz
    second = open_second_lead(src, d, lead="MLII", confirm_lead="V1")
    assert second.channels == (1, 1, 1)
    with pytest.raises(InputError) as e:
        open_second_lead(src, d, lead="MLII", confirm_lead="V5")
    assert one_line(e) == (f"{d / 'a.bdf'}: --confirm-lead 'V5' ('V5') is sampled at 128 Hz, --lead 'MLII' ('MLII') "
                           f"at 360 Hz; the second lead needs the first one's rate")


def test_folder_errors(tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    write(d / "a.edf")
    write(d / "b.edf", labels=["V5", "MLII", "V1"], rates=[360, 128, 360])
    with pytest.raises(InputError) as e:  # MLII at 360 Hz in a, 128 Hz in b
        open_source(d, lead="MLII")
    assert one_line(e) == f"{d}: recordings have different sampling rates on --lead 'MLII': [128.0, 360.0]"
    assert [r.fs for r in open_source(d, lead="V1").recordings] == [360, 360]
    with pytest.raises(InputError) as e:  # V5 is channel 2 of a, 0 of b
        open_source(d, lead="V6")
    assert one_line(e) == f"{d / 'a.edf'}: --lead 'V6': no channel of that label (channels: 0 'MLII', 1 'V1', 2 'V5')"
    write(d / "a.bdf")
    with pytest.raises(InputError) as e:
        open_source(d, lead="V1")
    assert one_line(e) == f"{d}: two files for recording 'a' (.edf and .bdf); keep one"
    (d / "a.bdf").unlink()
    (d / "rec.hea").write_text("rec 1 360 10\nrec.dat 16 200 16 0 0 0 0 MLII\n")
    with pytest.raises(InputError) as e:
        open_source(d)
    assert one_line(e) == (f"{d}: holds both WFDB records (.hea) and EDF/BDF files; put each kind in a folder "
                           f"of its own")


# ---- WFDB channels by signal name

def test_wfdb_channels_by_signal_name(tmp_path):
    import wfdb

    d = tmp_path / "db"
    d.mkdir()
    n = 3600
    sig = np.stack([np.sin(np.arange(n) / 20), 0.5 * np.cos(np.arange(n) / 30)], axis=1)
    wfdb.wrsamp("r1", fs=360, units=["mV", "mV"], sig_name=["MLII", "V5"], p_signal=sig, fmt=["16", "16"],
                write_dir=str(d))
    wfdb.wrsamp("r2", fs=360, units=["mV", "mV"], sig_name=["V5", "MLII"], p_signal=sig[:, ::-1].copy(),
                fmt=["16", "16"], write_dir=str(d))
    src = open_source(d, lead="mlii")
    assert src.kind == "wfdb" and src.channels == (0, 1)
    x = read_all(src, 4)
    np.testing.assert_allclose(x, np.concatenate([sig[:, 0], sig[:, 0]]), atol=1e-3)
    assert open_second_lead(src, d, lead="mlii", confirm_lead="V5").channels == (1, 0)
    with pytest.raises(InputError) as e:
        open_second_lead(src, d, lead="mlii", confirm_lead=0)  # r1's channel 0 is MLII
    assert one_line(e) == "--confirm-lead 0: the second lead must differ from --lead mlii (the same channel in r1)"
    with pytest.raises(InputError) as e:
        open_source(d, lead="V2")
    assert one_line(e) == f"{d / 'r1.hea'}: --lead 'V2': no channel of that label (channels: 0 'MLII', 1 'V5')"


def test_evaluate_loads_a_lead_by_signal_name(tmp_path):
    import wfdb

    from beatflow.score.evaluate import load_record

    n = 3600
    sig = np.stack([np.sin(np.arange(n) / 20), 0.5 * np.cos(np.arange(n) / 30)], axis=1)
    wfdb.wrsamp("r", fs=360, units=["mV", "mV"], sig_name=["MLII", "V5"], p_signal=sig, fmt=["16", "16"],
                write_dir=str(tmp_path))
    wfdb.wrann("r", "atr", np.array([100, 500]), np.array(["N", "N"]), write_dir=str(tmp_path))
    rec = load_record(str(tmp_path / "r"), "V5", second="MLII")
    np.testing.assert_allclose(rec.signal, sig[:, 1], atol=1e-3)
    np.testing.assert_allclose(rec.second, sig[:, 0], atol=1e-3)
    with pytest.raises(InputError) as e:
        load_record(str(tmp_path / "r"), "II")
    one_line(e, "--lead 'II': no channel of that label (channels: 0 'MLII', 1 'V5')")


def test_the_inbox_takes_edf_files(tmp_path):
    from beatflow.io.store import list_inbox

    write(tmp_path / "a.edf")
    write(tmp_path / "b.bdf")
    (tmp_path / "c.txt").write_text("x")
    assert [p.name for p in list_inbox(tmp_path)] == ["a.edf", "b.bdf"]


# ---- bad files: one line naming the file and the problem

def _bad(tmp_path, case):
    """A bad input for ``case``: (path, --lead, the message expected)."""
    p = write(tmp_path / "r.edf")
    size = p.stat().st_size
    ns = 4  # (three signals and EDF+'s annotation channel)
    record_bytes = (360 + 360 + 128 + 57) * 2  # (pyedflib writes 57 samples of annotations a record)
    header = 256 * (ns + 1)
    if case == "truncated":
        p.write_bytes(p.read_bytes()[: size - 1000])
        return p, 0, (f"{p}: {size - 1000} bytes, the header needs {SECONDS} data records of {record_bytes} bytes "
                      f"+ {header} header bytes ({size} bytes): truncated?")
    if case == "header cut":
        p.write_bytes(p.read_bytes()[:600])
        return p, 0, f"{p}: 600 bytes, the header of {ns} signals takes {header}: truncated?"
    if case == "not edf":
        p.write_text("heartbeats\n" + "0.1\n" * 100)
        return p, 0, (f"{p}: not an EDF or BDF file (the version field is b'heartbea', not b'0       ' or "
                      f"b'\\xffBIOSEMI')")
    if case == "edf+d":
        patch(p, 192, "EDF+D")
        return p, 0, (f"{p}: a discontinuous EDF+ file (EDF+D: its data records have gaps in time); beatflow reads "
                      f"continuous recordings (EDF+C, BDF+C or plain EDF/BDF)")
    if case == "no records":
        patch(p, 236, "0       ")
        p.write_bytes(p.read_bytes()[:header])
        return p, 0, f"{p}: no samples (0 data records)"
    if case == "unfinished":
        patch(p, 236, "-1      ")
        return p, 0, f"{p}: the header gives -1 data records (the recorder did not finish the file)"
    if case == "rate zero":
        patch(p, signal_field(ns, "samples_per_record", 2), "0       ")
        return p, "V5", f"{p}: channel 'V5' has 0 samples per data record; its sampling rate is not positive"
    if case == "duration zero":
        patch(p, 244, "0       ")
        return p, 0, (f"{p}: data record duration 0 s; the sampling rates (samples per data record / duration) "
                      f"are not positive")
    if case == "rate too low":  # 128 samples per 4 s: 32 Hz
        patch(p, 244, "4       ")
        return p, "V5", f"{p}: channel 2 'V5': 128 samples per 4 s data record; {check_fs(32.0)}"
    if case == "unknown label":
        return p, "V6", f"{p}: --lead 'V6': no channel of that label (channels: 0 'MLII', 1 'V1', 2 'V5')"
    if case == "under another suffix":
        q = p.rename(tmp_path / "r.csv")
        return q, 0, f"{q}: an EDF/BDF file under another suffix; rename it to r.edf"
    if case == "bad field":
        patch(p, signal_field(ns, "physical_max", 0), "abc     ")
        return p, 0, f"{p}: not a readable EDF+ file (the file is not EDF(+) or BDF(+) compliant (Physical Maximum))"
    raise KeyError(case)


BAD = ["truncated", "header cut", "not edf", "edf+d", "no records", "unfinished", "rate zero", "duration zero",
       "rate too low", "unknown label", "under another suffix", "bad field"]


@pytest.mark.parametrize("case", BAD)
def test_bad_files_are_one_line(tmp_path, case):
    p, lead, message = _bad(tmp_path, case)
    with pytest.raises(InputError) as e:
        open_source(p, lead=lead)
    assert one_line(e) == message


@pytest.mark.parametrize("case", ["truncated", "not edf", "edf+d", "rate zero", "unknown label", "no records"])
def test_bad_files_through_the_cli(tmp_path, case):
    p, lead, message = _bad(tmp_path, case)
    before = sorted(q.relative_to(tmp_path) for q in tmp_path.rglob("*"))
    r = run_cli(["run", "--input", p, "--lead", lead, "--out", tmp_path / "out"], DEAD_API, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"beatflow: error: {message}\n", r.stderr  # the whole output: one line
    assert sorted(q.relative_to(tmp_path) for q in tmp_path.rglob("*")) == before  # nothing left behind


def test_second_lead_errors_through_the_cli(tmp_path):
    p = write(tmp_path / "r.edf")
    for args, message in (
            (["--lead", "MLII", "--confirm-lead", "V5"],
             f"{p}: --confirm-lead 'V5' ('V5') is sampled at 128 Hz, --lead 'MLII' ('MLII') at 360 Hz; "
             f"the second lead needs the first one's rate"),
            (["--lead", "MLII", "--confirm-lead", "0"],
             "--confirm-lead 0: the second lead must differ from --lead MLII (the same channel in r)"),
            (["--confirm-lead", "II"],
             f"{p}: --confirm-lead 'II': no channel of that label (channels: 0 'MLII', 1 'V1', 2 'V5')"),
            (["--confirm-column", "V1"], f"{p}: EDF input takes --confirm-lead N or LABEL, not --confirm-column")):
        r = run_cli(["run", "--input", p, *args, "--out", tmp_path / "out"], DEAD_API, timeout=120)
        assert r.returncode == 2 and r.stderr == f"beatflow: error: {message}\n", r.stderr
        assert not (tmp_path / "out").exists()


# ---- the whole flow on an EDF file

def test_run_on_an_edf_file(prefect_server, tmp_path):
    """``beatflow run --input x.edf --lead ECG``: ten minutes of the synthetic ECG, written in microvolts
    beside a channel of another rate, give the generator's beats."""
    from beatflow.io.synth import synthesize_ecg

    ecg = synthesize_ecg(hours=10 / 60, fs=250.0, seed=5)
    n = ecg.signal.shape[0]
    resp = np.sin(np.arange(n * 64 // 250) * 2 * np.pi * 0.25 / 64) * 100.0
    p = write(tmp_path / "x.edf", [ecg.signal.astype(np.float64) * 1000.0, resp], labels=["ECG", "Resp"],
              rates=[250, 64], dims=["uV", "uV"], phys=[(-8000.0, 8000.0), (-200.0, 200.0)])
    out = tmp_path / "out"
    r = run_cli(["run", "--input", p, "--lead", "ecg", "--epochs", "1", "--device", "cpu", "--workers", "2",
                 "--partitions", "3", "--out", out], prefect_server)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["fs"] == 250 and s["samples"] == n and s["recordings"] == ["x"]
    truth = int((~ecg.beat_unreadable).sum())  # (no beats are kept in the unreadable episodes)
    assert abs(s["beats_detected"] - truth) <= 0.02 * truth, (s["beats_detected"], truth)
    assert (out / "report.html").exists() and (out / "anomalies.parquet").exists()


# ---- the command line's lead options, the inbox

def test_lead_options_take_an_index_or_a_label():
    import argparse

    from beatflow.io.channels import parse_lead

    assert parse_lead("2") == 2 and parse_lead(" 0 ") == 0 and parse_lead("-1") == -1
    assert parse_lead("MLII") == "MLII" and parse_lead(" ECG V5 ") == "ECG V5"
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lead("  ")


def test_score_an_inbox_of_edf_files(prefect_server, trained_store, tmp_path):
    """``beatflow score --lead ECG --confirm-lead ECG2``: an EDF file at the model's rate is scored on its
    ECG channel checked by the second one; one at another rate goes to failed/."""
    from beatflow.io.store import Store
    from beatflow.io.synth import synthesize_ecg
    from beatflow.pipeline.inbox_flow import score_new_recordings

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    ecg = synthesize_ecg(hours=0.05, fs=250.0, seed=2).signal.astype(np.float64)
    write(inbox / "night.edf", [ecg * 1000.0, ecg * 800.0], labels=["ECG", "ECG2"], rates=[250, 250],
          dims=["uV", "uV"], phys=[(-8000.0, 8000.0)] * 2)
    fast = synthesize_ecg(hours=0.05, fs=360.0, seed=2).signal.astype(np.float64)
    write(inbox / "fast.bdf", [fast, fast], labels=["ECG", "ECG2"], rates=[360, 360], dims=["mV", "mV"],
          phys=[(-8.0, 8.0)] * 2)
    res = score_new_recordings(inbox=str(inbox), store=str(trained_store), lead="ECG", confirm_lead="ECG2")
    status = {r["item"]: r["status"] for r in res["processed"]}
    assert status == {"night.edf": "done", "fast.bdf": "failed"}, res
    assert "model was trained on 256" in (inbox / "failed" / "fast.bdf.reason.txt").read_text()
    night = [r for r in res["processed"] if r["item"] == "night.edf"][0]
    df = Store(trained_store).read_results()
    assert len(df) == night["beats"] > 200 and set(df["recording"].astype(str)) == {"night"}
