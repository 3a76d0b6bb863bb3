"""The flow end to end on small data: a Dask LocalCluster of 2 workers, a real Prefect server."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from beatflow.params import SegmentParams
from conftest import run_cli

SUMMARY_KEYS = {"samples", "fs", "beats_detected", "beats_kept", "pruned_fraction", "train_loss", "test_loss",
                "anomalies_flagged", "device", "workers", "engine", "timings_s", "truth"}


def run_flow(out, **kw):
    from beatflow.pipeline.flow import ecg_anomaly_flow
    from beatflow.pipeline.cluster import make_task_runner

    runner = make_task_runner("cpu", 2)
    return ecg_anomaly_flow.with_options(task_runner=runner)(out=str(out), device="cpu", workers=2, **kw)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_flow_on_synthetic_ecg_under_test_harness(harness, tmp_path):
    out = tmp_path / "run"
    summary = run_flow(out, hours=0.25, seed=5, epochs=3, partitions=3)
    files = {p.name for p in out.iterdir()}
    assert {"summary.json", "anomalies.parquet", "report.html", "model.pt", "engine.onnx", "rhythm_episodes.csv"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    saved = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(saved)
    assert saved["samples"] == int(0.25 * 3600 * 250) and saved["partitions"] == 3
    assert saved["workers_reporting"] == 2  # the flow reached both Dask workers (transfer/RMM counters)
    rss = saved["peak_rss_bytes"]  # the flow process's and the largest worker's peak memory (getrusage)
    assert rss["workers"] == 2 and 50 * 2**20 < rss["flow"] < 8 * 2**30 and 50 * 2**20 < rss["largest_worker"] < 8 * 2**30
    assert saved["workers_scoring"] == 2  # scoring on the partitions' workers, not all on training's
    assert len(saved["train_loss"]) == 3 and saved["train_loss"][-1] < saved["train_loss"][0]
    assert saved["training"]["compiled"] is False  # too small a training to pay for compiling it on the CPU
    assert saved["truth"]["se"] > 0.99 and saved["truth"]["ppv"] > 0.99
    assert saved["truth"]["auc"] > 0.8
    assert saved["flutter_episodes"] == {"count": 0, "seconds": 0.0}  # the synthetic ECG has none
    assert len(pd.read_csv(out / "rhythm_episodes.csv")) == 0
    assert saved["engine"]["max_abs_err"] < 1e-4 and saved["engine"]["backend"] == "onnxruntime"
    assert saved["engine"]["clock"] == "monotonic" and 0 < saved["engine"]["latency_batch1_us"]["p50"] < 1e5
    assert saved["engine"]["profile_measured"]  # (when: a cache hit reports the profile measured at build)
    assert set(saved["engine"]["throughput_by_batch"]) == {"1", "32", "256", "1024", "8192"}
    assert {"load", "segment", "embed", "train", "engine", "score", "report", "total"} <= set(saved["timings_s"])
    # training and the engine ran on a worker as Dask tasks followed from here: their span and the
    # engine's phases are reported (a fresh engine: built, its reference computed)
    detail = saved["timings_detail_s"]
    for stage in ("train", "engine"):
        assert detail[stage]["dispatch"] >= 0 and detail[stage]["work"] > 0 and detail[stage]["return"] >= 0
        assert detail[stage]["work"] <= saved["timings_s"][stage] + 0.01
    assert detail["engine"]["build"] > 0 and detail["engine"]["reference"] == "computed"
    # and training's parts: the matrix's set-up, train_vae's, saving: parts of the task's work
    train = detail["train"]
    parts = ("rows", "train_setup", "train_epochs", "train_test", "train_other", "save")
    assert train["train_epochs"] > 0 and all(train[k] >= -1e-3 for k in parts), train
    assert sum(train[k] for k in parts) <= train["work"] + 0.01, train
    # the load stage's parts: every partition's read and its (here host) copy measured on its worker
    load = detail["load"]
    assert {"partitions", "edges", "setup_max", "setup_sum", "read_max", "read_sum", "to_device_max",
            "to_device_sum", "dispatch", "on_workers", "return"} == set(load), load
    assert 0 < load["read_max"] <= load["read_sum"] and load["read_max"] <= load["partitions"]
    # the partitions' time split around the reads' wall-clock spans on the workers (one host: exact)
    assert load["dispatch"] >= 0 and load["return"] >= 0 and load["on_workers"] >= load["read_max"], load
    assert abs(load["dispatch"] + load["on_workers"] + load["return"] - load["partitions"]) < 0.01, load
    assert load["partitions"] + load["edges"] <= saved["timings_s"]["load"] + 0.01
    # the scoring and report stages' parts
    assert {"engine", "classes", "truth", "figures_started", "context", "table"} == set(detail["score"])
    assert {"data", "stats_artifact", "figures_wait", "write"} == set(detail["report"])
    for stage in ("score", "report"):
        assert all(v >= 0 for v in detail[stage].values())
        assert sum(detail[stage].values()) <= saved["timings_s"][stage] + 0.01
    # every figure drawn in the flow's figure processes: how long it waited for one, and drew there
    from beatflow.report.figures import FIGURES

    assert set(detail["figures"]) == set(FIGURES), detail["figures"]
    assert all(t["draw"] > 0 and t["queued"] >= 0 for t in detail["figures"].values())
    table = pd.read_parquet(out / "anomalies.parquet")
    assert len(table) == saved["beats_kept"] and table["flagged"].sum() == saved["anomalies_flagged"]
    assert list(table.columns) == ["beat", "recording", "start", "peak", "time_s", "length", "score", "flagged", "rank",
                                   "class", "rr_prev_s", "rr_next_s", "prematurity"]
    # every kept beat classed; the summary counts the table's classes, per recording too
    assert set(table["class"].astype(str)) <= {"N", "S", "V"}
    counts = table["class"].astype(str).value_counts().to_dict()
    assert {k: v for k, v in saved["classes"]["counts"].items() if v} == counts
    assert saved["per_recording"][0]["classes"] == saved["classes"]["counts"]
    assert saved["classes"]["counts"]["V"] > 0 and 0 < saved["classes"]["v_burden_pct"] < 10
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64") >= 6
    assert "Inference engine" in html and "latency, batch 1" in html
    # the stages' times up to the report's own, and the top anomalies' panels (drawn before the table's file)
    assert "Per-stage timings" in html and '<td class="l">train</td>' in html and '<td class="l">total</td>' not in html
    assert f"<h3>Top {min(12, saved['beats_kept'])} in context</h3>" in html
    assert summary["beats_kept"] == saved["beats_kept"]
    assert "Latent space by truth label" in html  # (a synthetic run has a truth)
    # the training's progress artifact (made once the training task was submitted) reached 100 %
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

    with get_client(sync_client=True) as client:
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["table"])))
        notes = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["markdown"])))
    # the UI's link to this run's report, at its final place (Prefect keeps a link artifact as markdown)
    assert any(a.key == "beatflow-report" and f"]({(out / 'report.html').resolve().as_uri()})" in a.data
               for a in notes), [a.key for a in notes]
    assert [a.data for a in progress if "VAE training" in (a.description or "")] == [100.0], progress
    # the top anomalies' table (published while the figures were drawn) and the run's summary
    top_rows = json.loads([a for a in tables if a.key == "beatflow-top-anomalies"][-1].data)
    # (the anomaly list is led by the beats classed V or S, highest rank first)
    ectopic = table[table["class"].astype(str).isin(["V", "S"])]
    assert len(ectopic) >= 12
    assert [r["beat"] for r in top_rows] == ectopic.nsmallest(len(top_rows), "rank")["beat"].tolist()
    assert {r["class"] for r in top_rows} <= {"V", "S"} and len(top_rows) == 12
    assert any(a.key == "beatflow-summary" and f"| beats_kept | {saved['beats_kept']} |" in a.data
               and "| classes | N " in a.data for a in notes)

    # any partition count gives the same beats and (up to float noise) the same scores
    other = run_flow(tmp_path / "run7", hours=0.25, seed=5, epochs=3, partitions=7)
    t7 = pd.read_parquet(tmp_path / "run7" / "anomalies.parquet")
    np.testing.assert_array_equal(t7["peak"], table["peak"])
    np.testing.assert_allclose(t7["score"], table["score"], rtol=1e-4, atol=1e-6)
    assert other["beats_detected"] == saved["beats_detected"]


def test_flow_lists_a_flutter_episode(harness, tmp_path):
    """An ECG with a ventricular flutter episode: the episode is listed (rhythm_episodes.csv, the
    summary, the report) and its waves are not counted as beats."""
    from test_rhythm import _stream

    x, a, b = _stream(11, 250.0, seconds=240.0)
    p = tmp_path / "ecg.npy"
    np.save(p, x)
    out = tmp_path / "run"
    summary = run_flow(out, input=str(p), fs=250.0, epochs=2, partitions=3)
    ep = pd.read_csv(out / "rhythm_episodes.csv")
    assert list(ep.columns) == ["recording", "start_s", "end_s", "duration_s"]
    assert len(ep) == 1 and summary["flutter_episodes"]["count"] == 1
    start, end = float(ep["start_s"].iloc[0]), float(ep["end_s"].iloc[0])
    assert a / 250.0 - 3 < start < a / 250.0 + 6 and b / 250.0 - 6 < end < b / 250.0 + 3  # the flutter, in seconds
    assert summary["flutter_episodes"]["seconds"] == end - start
    peaks = pd.read_parquet(out / "anomalies.parquet")["peak"].to_numpy()
    assert not ((peaks >= start * 250 + 250) & (peaks < end * 250 - 250)).any()  # no beats inside
    assert "VF / flutter episodes" in (out / "report.html").read_text()


def test_cli_on_one_mitbih_record(prefect_server, mitdb, tmp_path):
    import shutil

    rec = tmp_path / "rec"
    rec.mkdir()
    for ext in ("hea", "dat"):
        shutil.copy(mitdb / f"119.{ext}", rec)
    out = tmp_path / "out"
    r = run_cli(["run", "--input", rec, "--epochs", "2", "--device", "cpu", "--workers", "2", "--out", out],
                prefect_server)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["fs"] == 360 and s["samples"] == 650000 and s["recordings"] == ["119"]
    # record 119 has 1987 annotated beats, many of them ventricular bigeminy
    assert 1900 < s["beats_detected"] < 2100
    assert "truth" not in s
    assert "report.html" in r.stdout


def test_cli_second_lead_on_mitbih_207(prefect_server, mitdb, tmp_path):
    """``--confirm-lead 1`` on record 207 (flutter, bundle branch blocks), cut into 5 partitions: the
    flow gives exactly the beats of the whole record's rules (beatflow.detect.leads: dropped and moved)."""
    import shutil

    from beatflow.embed.beats import beats_from_peaks
    from beatflow.score.evaluate import load_record
    from beatflow.detect import second_lead_peaks
    from beatflow.detect import detect_peaks

    rec = tmp_path / "rec"
    rec.mkdir()
    for ext in ("hea", "dat"):
        shutil.copy(mitdb / f"207.{ext}", rec)
    for args, message in ((["--confirm-lead", "0"], "must differ from --lead 0"),
                          (["--confirm-lead", "2"], "lead 2 does not exist"),
                          (["--confirm-column", "MLII"], "WFDB input takes --confirm-lead")):
        r = run_cli(["run", "--input", rec, *args, "--out", tmp_path / "bad"], "http://127.0.0.1:9/api", timeout=120)
        assert r.returncode == 2 and message in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    r = run_cli(["run", "--input", rec, "--confirm-lead", "1", "--epochs", "1", "--device", "cpu", "--workers", "2",
                 "--partitions", "5", "--out", out], prefect_server)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    r0 = load_record(str(mitdb / "207"), 0, second=1)
    seg = SegmentParams().samples(r0.fs)
    peaks = detect_peaks(r0.signal, seg)
    want, episodes, dropped, moved = second_lead_peaks(r0.signal, r0.second, peaks, r0.fs, seg)
    beats = beats_from_peaks(want, seg, r0.signal.shape[0])[0]  # (the last peak makes no beat)
    assert s["beats_detected"] == len(beats) and len(want) < len(peaks) - 20
    assert s["second_lead"]["lead"] == 1 and s["second_lead"]["doubtful_peaks_dropped"] == dropped >= 1
    assert s["second_lead"]["peaks_moved"] == moved >= 1  # (207's misplaced peaks: beatflow.detect.leads.misplaced)
    html = (out / "report.html").read_text()
    assert "second_lead" in html and "second lead (lead 1)" in html  # (the settings table, a summary card)
    assert "second lead" in r.stdout  # (the CLI's closing table)
    assert s["flutter_episodes"]["count"] == len(episodes)
    table = pd.read_parquet(out / "anomalies.parquet")
    assert np.isin(table["peak"].to_numpy(), want).all()


@pytest.mark.parametrize("content,message", [
    ("heartbeats\n" + "0.1\n" * 300 + "zz\n" + "0.2\n" * 300, "line 302: cannot parse 'zz' as a number"),
    ("heartbeats\n" + "0.1\n" * 3000 + "inf\n" + "0.2\n" * 300, "line 3002: non-finite or missing value 'inf'"),
    ("heartbeats\n" + "0.1\n" * 3000 + "nan\n" + "0.2\n" * 300, "line 3002: non-finite or missing value 'nan'"),
    ("heartbeats\n" + "0.1\n" * 3000 + "1e300\n" + "0.2\n" * 300, "line 3002: "),
    ("heartbeats\n" + "0.1\n" * 3000 + "1,5\n" + "0.2\n" * 300, "line 3002: "),
    ("heartbeats\n" + "0.5\n" * 20000, "no ECG found: the whole recording is unreadable (flat)"),
    ("heartbeats\n" + "0.5\n" * 100, "100 samples is too short for a beat"),
    ("heartbeats\n0.1\n0.2\n0.3\n", "3 samples is too short for a beat"),
])
def test_cli_bad_input_inside_the_flow(prefect_server, tmp_path, content, message):
    """Errors found by the workers reach the terminal as one line (the file, the line, the value, the
    problem, and where the run's log is); Dask's and Prefect's tracebacks are in that log."""
    p = tmp_path / "in.csv"
    p.write_text(content)
    out = tmp_path / "out"
    r = run_cli(["run", "--input", p, "--device", "cpu", "--workers", "2", "--partitions", "3", "--out", out],
                prefect_server)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"beatflow: error: {p}"), r.stderr[-3000:]
    assert message in r.stderr, r.stderr
    log = Path(r.stderr.rsplit("(details: ", 1)[1].rstrip(")\n"))
    assert log.exists() and "Traceback" in log.read_text()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["in.csv"]  # no --out, no .partial folder


def test_cli_pure_noise_is_no_ecg(prefect_server, tmp_path):
    """Ten minutes of white noise (a .npy at 250 Hz): one line, exit 2, no output folder; the detector
    alone finds hundreds of "beats" in it, the signal quality calls all of it unreadable."""
    p = tmp_path / "noise.npy"
    np.save(p, np.random.default_rng(0).normal(0.0, 1.0, 150_000).astype(np.float32))
    out = tmp_path / "out"
    r = run_cli(["run", "--input", p, "--fs", "250", "--device", "cpu", "--workers", "2", "--partitions", "3",
                 "--out", out], prefect_server)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"{p}: no ECG found: the whole recording is unreadable (noise)" in r.stderr, r.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["noise.npy"]


def test_flow_lists_an_unreadable_stretch(harness, tmp_path):
    """Noise in the middle of an ECG: the stretch is listed (quality.csv, the summary, the report) and
    no beats are detected in it."""
    from beatflow.io.synth import synthesize_ecg

    syn = synthesize_ecg(hours=0.07, seed=2)
    x = syn.signal.copy()
    a, b = int(100 * 250), int(130 * 250)
    x[a:b] = np.random.default_rng(0).normal(0.0, 0.5, b - a).astype(np.float32)
    p = tmp_path / "ecg.npy"
    np.save(p, x)
    out = tmp_path / "run"
    summary = run_flow(out, input=str(p), fs=250.0, epochs=2, partitions=3)
    qc = pd.read_csv(out / "quality.csv")
    assert list(qc.columns) == ["recording", "start_s", "end_s", "duration_s", "reason"]
    assert len(qc) == 1 and qc["reason"].iloc[0] == "noise"
    start, end = float(qc["start_s"].iloc[0]), float(qc["end_s"].iloc[0])
    assert 96 <= start <= 100 and 126 <= end <= 134  # whole windows of 4 s: one half noise may be read
    assert summary["quality"]["episodes"] == 1 and summary["quality"]["unreadable_s"] == end - start
    peaks = pd.read_parquet(out / "anomalies.parquet")["peak"].to_numpy()
    assert not ((peaks >= start * 250) & (peaks < end * 250)).any()
    assert "Unreadable stretches" in (out / "report.html").read_text()


@pytest.mark.parametrize("setup,args,message", [
    (None, ["--input", "{d}/missing.csv"], "missing.csv: no such file or folder"),
    ("", ["--input", "{d}/in.csv"], "in.csv: empty file"),
    ("heartbeats\n", ["--input", "{d}/in.csv"], "in.csv: header only, no samples"),
    ("a,b\n1,2\n", ["--input", "{d}/in.csv", "--column", "c"], "unknown column 'c' (columns: a, b)"),
    ("mkdir", ["--input", "{d}/empty"], "no WFDB records (.hea files) in this folder"),
    (None, ["--hours", "-1"], "--hours -1: the synthetic ECG's length must be between"),
    (None, ["--hours", "inf"], "--hours inf: the synthetic ECG's length must be between"),
    (None, ["--hours", "nan"], "--hours nan: the synthetic ECG's length must be between"),
    (None, ["--hours", "0.0001"], "--hours 0.0001: the synthetic ECG's length must be between 0.0333 h"),
    (None, ["--seed", "-1"], "--seed -1: the seed must be a non-negative integer"),
    (None, ["--fs", "inf"], "--fs inf: sampling rate must be between 50 and 20000 Hz"),
    (None, ["--fs", "1e9"], "--fs 1e+09: sampling rate must be between 50 and 20000 Hz"),
    (None, ["--fs", "0"], "--fs 0: sampling rate must be between"),
    (None, ["--workers", "0"], "--workers must be positive"),
    ("file", ["--out", "{d}/in.csv"], "in.csv: exists and is not a folder"),
    ("file", ["--out", "{d}/in.csv/sub/out"], "in.csv is a file, not a folder"),
    (None, ["--out", "/proc/beatflow-x/out"], "cannot create a folder in /proc"),
    ("full", ["--out", "{d}/full"], "full: output folder exists and is not empty"),
    ("gzip", ["--input", "{d}/in.csv.gz"], "in.csv.gz: gzip-compressed; decompress it first (gunzip"),
    ("gzip", ["--input", "{d}/in.csv"], "in.csv: gzip-compressed; decompress it first"),
    ("parquet-text", ["--input", "{d}/in.parquet"], "column 'ecg' is not numeric (type "),
    ("parquet-numtext", ["--input", "{d}/in.parquet"], "column 'ecg' holds numbers stored as text"),
    ("wfdb-no-dat", ["--input", "{d}/rec"], "signal file r.dat is missing"),
    ("wfdb-short", ["--input", "{d}/rec"], "the header needs 5000 samples"),
    (None, ["--device", "cpu", "--train-precision", "bf16"], "--train-precision bf16 is for GPUs"),
    (None, ["--device", "cpu", "--engine", "compiled"], "backend compiled does not do fp32 on the CPU"),
    (None, ["--device", "cpu", "--precision", "fp16"], "precision fp16 is for GPUs"),
    (None, ["--confirm-lead", "1"], "need --input (the synthetic ECG has one lead)"),
    ("a,b\n1,2\n", ["--input", "{d}/in.csv", "--column", "a", "--confirm-lead", "1"], "takes --confirm-column"),
    ("a,b\n1,2\n", ["--input", "{d}/in.csv", "--column", "a", "--confirm-column", "a"], "must differ"),
    ("a,b\n1,2\n", ["--input", "{d}/in.csv", "--column", "a", "--confirm-column", "c"], "unknown column 'c'"),
])
def test_cli_bad_input_before_the_flow(tmp_path, setup, args, message):
    if setup == "mkdir":
        (tmp_path / "empty").mkdir()
    elif setup == "file":
        (tmp_path / "in.csv").write_text("heartbeats\n0.1\n")
    elif setup == "full":
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "mine.txt").write_text("keep me")
    elif setup == "gzip":
        import gzip

        data = gzip.compress(b"heartbeats\n" + b"0.1\n" * 1000)
        (tmp_path / "in.csv.gz").write_bytes(data)
        (tmp_path / "in.csv").write_bytes(data)
    elif setup in ("parquet-text", "parquet-numtext"):
        values = ["0.12", "0.5"] * 100 if setup == "parquet-numtext" else ["a", "b"] * 100
        pd.DataFrame({"ecg": values}).to_parquet(tmp_path / "in.parquet")
    elif setup in ("wfdb-no-dat", "wfdb-short"):
        import wfdb

        (tmp_path / "rec").mkdir()
        wfdb.wrsamp("r", fs=250, units=["mV"], sig_name=["I"], p_signal=np.zeros((5000, 1)), fmt=["16"],
                    write_dir=str(tmp_path / "rec"))
        dat = tmp_path / "rec" / "r.dat"
        dat.unlink() if setup == "wfdb-no-dat" else dat.write_bytes(dat.read_bytes()[:1200])
    elif setup is not None:
        (tmp_path / "in.csv").write_text(setup)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = [a.format(d=tmp_path) for a in args]
    out = [] if "--out" in args else ["--out", tmp_path / "out"]
    r = run_cli(["run", *args, *out], "http://127.0.0.1:9/api", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("beatflow: error: "), r.stderr  # the whole output
    assert message in r.stderr, r.stderr
    assert "details:" not in r.stderr  # (nothing started: no run log to point at)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing left behind


def test_cli_gpu_without_cuda_is_one_line(tmp_path):
    r = run_cli(["run", "--device", "gpu", "--out", tmp_path / "o"], "http://127.0.0.1:9/api", timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("beatflow: error: --device gpu: no CUDA device")


def test_cache_reuses_segmentation_and_training(prefect_server, tmp_path):
    """A second run of an unchanged input with --cache reuses the persisted segment and train results."""
    from beatflow.io.synth import synthesize_ecg

    x = synthesize_ecg(hours=0.1, fs=250.0, seed=8).signal
    p = tmp_path / "in.csv"
    p.write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")
    cache = tmp_path / "cache"
    args = ["run", "--input", p, "--epochs", "2", "--device", "cpu", "--workers", "2", "--cache", cache,
            "--verbose"]  # (the flow's log on the terminal, read below)
    first = run_cli([*args, "--out", tmp_path / "a"], prefect_server)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_cli([*args, "--out", tmp_path / "b"], prefect_server)
    assert second.returncode == 0, second.stderr[-2000:]
    log = second.stdout + second.stderr
    assert "train-vae" in log and "Finished in state Cached" in log
    cached = [ln for ln in log.splitlines() if "Finished in state Cached" in ln]
    assert [ln for ln in cached if "Task run 'train-vae-" in ln]  # training
    assert [ln for ln in cached if "Task run 'segment-" in ln]  # segmentation, every partition in one result
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("a", "b"))
    assert a["train_loss"] == b["train_loss"] and a["beats_detected"] == b["beats_detected"]
    assert (tmp_path / "a" / "model.pt").read_bytes() == (tmp_path / "b" / "model.pt").read_bytes()
    # a changed input is a new key: recomputed, not served from the cache
    p.write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x[::-1]) + "\n")
    third = run_cli([*args, "--out", tmp_path / "c"], prefect_server)
    assert third.returncode == 0 and "Finished in state Cached" not in third.stdout + third.stderr


def test_flow_second_lead_from_csv(harness, tmp_path):
    """``confirm_column``: the second lead from another CSV column, 3 partitions: the beats of the
    whole recording's rules (beatflow.detect.leads); a bad pair of leads is one clear error, no output."""
    from beatflow.embed.beats import beats_from_peaks
    from beatflow.errors import InputError
    from beatflow.detect import second_lead_peaks
    from beatflow.detect import detect_peaks
    from test_leads import _two_leads

    x0, x1 = _two_leads(3, 250.0, 240.0)  # (its noise bursts leave doubtful peaks on the first lead)
    p = tmp_path / "two.csv"
    p.write_text("a,b\n" + "\n".join(f"{u:.5f},{v:.5f}" for u, v in zip(x0, x1)) + "\n")
    back = pd.read_csv(p, dtype=np.float32)  # the values as the flow reads them (float32)
    a, b = back["a"].to_numpy(), back["b"].to_numpy()
    s = SegmentParams().samples(250.0)
    peaks = detect_peaks(a, s)
    want, _, dropped, moved = second_lead_peaks(a, b, peaks, 250.0, s)
    summary = run_flow(tmp_path / "out", input=str(p), column="a", confirm_column="b", partitions=3, epochs=1)
    assert summary["beats_detected"] == len(beats_from_peaks(want, s, a.shape[0])[0])
    assert summary["second_lead"]["column"] == "b" and summary["second_lead"]["lead"] is None
    assert summary["second_lead"]["doubtful_peaks_dropped"] == dropped > 0
    assert summary["second_lead"]["peaks_moved"] == moved
    assert "second lead (column b)" in (tmp_path / "out" / "report.html").read_text()
    with pytest.raises(InputError, match="must differ"):
        run_flow(tmp_path / "bad", input=str(p), column="a", confirm_column="a", epochs=1)
    assert not (tmp_path / "bad").exists()


def test_flow_threshold_spread_within_recordings(harness, tmp_path):
    """A folder of two recordings whose normal beats differ in noise: the flagging threshold takes
    its spread within recordings (beatflow.score.rule.robust_threshold with the beats' recordings), which
    the difference between the recordings' levels does not widen."""
    import wfdb

    from beatflow.score.rule import robust_threshold
    from beatflow.io.synth import synthesize_ecg

    folder = tmp_path / "records"
    folder.mkdir()
    for name, seed, noise in (("clean", 1, 0.01), ("noisy", 2, 0.15)):
        e = synthesize_ecg(hours=0.15, fs=250.0, seed=seed, pvc_rate=0.03, noise_mv=noise)
        wfdb.wrsamp(name, fs=250, units=["mV"], sig_name=["ECG"], p_signal=e.signal[:, None].astype(np.float64),
                    fmt=["16"], write_dir=str(folder))
    out = tmp_path / "run"
    summary = run_flow(out, input=str(folder), epochs=2, partitions=3)
    table = pd.read_parquet(out / "anomalies.parquet")
    assert set(table["recording"].astype(str)) == {"clean", "noisy"}
    want = robust_threshold(table["score"], recording=table["recording"].astype(str).to_numpy())
    assert summary["threshold"] == pytest.approx(want, rel=1e-6)
    assert want < robust_threshold(table["score"])  # (the spread around one median is the wider)
    assert table["flagged"].sum() == summary["anomalies_flagged"] == int((table["score"] > want).sum())
    # per recording: the summary's counts, the report's table and the stream figure's boundaries
    per = {r["recording"]: r for r in summary["per_recording"]}
    assert set(per) == {"clean", "noisy"} and all(r["hours"] == pytest.approx(0.15) for r in per.values())
    for name, r in per.items():
        mine = table[table["recording"].astype(str) == name]
        assert r["beats"] == len(mine) > 100 and r["flagged"] == int(mine["flagged"].sum())
    html = (out / "report.html").read_text()
    assert "<h3>Recordings</h3>" in html and "<td class=l>noisy</td>" in html


@pytest.mark.parametrize("seed", range(3))
def test_report_top_rows_are_the_tables_top_ranks(seed):
    """The report's top anomalies (taken from the scores, before the table exists) are the anomaly table's
    ranks 1..N in order, ties included, with the table's start, time, length and score."""
    from types import SimpleNamespace

    from beatflow.score.rule import anomaly_table
    from beatflow.report.data import N_TOP, top_list

    rng = np.random.default_rng(seed)
    n = 500
    scores = rng.integers(0, 30, n).astype(np.float32)  # many ties
    kb = np.sort(rng.choice(2 * n, size=n, replace=False))
    plan = SimpleNamespace(start=np.arange(2 * n) * 200, length=rng.integers(100, 300, 2 * n),
                           owner=np.zeros(2 * n, int), recording=np.zeros(2 * n, int))
    table = anomaly_table(kb, plan.recording[kb], plan.start[kb], plan.start[kb], plan.length[kb], scores, 250.0,
                          1e9, ["r"])
    rows = np.argsort(-scores, kind="stable")[:N_TOP]
    ctx = {0: [(int(plan.start[b]) - 250, np.zeros(3, np.float32)) for b in kb]}
    top = top_list(["r"], 250.0, plan, rows, scores, ctx, kb, None)
    want = table.nsmallest(N_TOP, "rank")
    assert [t["beat"] for t in top] == want["beat"].tolist()
    assert [t["start"] for t in top] == want["start"].tolist()
    assert [t["length"] for t in top] == want["length"].tolist()
    assert [t["score"] for t in top] == want["score"].astype(float).tolist()
    assert [t["time_s"] for t in top] == want["time_s"].tolist()
    assert all(t["context_start"] == t["start"] - 250 for t in top)


def test_run_options_are_the_flows_parameters():
    """``RunOptions`` holds every parameter of the flow, with the same defaults (the flow's signature is what
    the CLI, the deployments and the Prefect UI use), and stays one value (frozen)."""
    import dataclasses
    import inspect

    from beatflow.pipeline.flow import ecg_anomaly_flow
    from beatflow.pipeline.options import RunOptions

    params = inspect.signature(ecg_anomaly_flow.fn).parameters
    fields = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    assert list(fields) == list(params)
    assert fields == {name: p.default for name, p in params.items()}
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunOptions().epochs = 3
