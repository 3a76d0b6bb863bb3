"""beatflow.run and beatflow.read, the Python API: the CLI's options, the same flow, the same errors."""
from __future__ import annotations

import doctest
import json

import numpy as np
import pandas as pd
import pytest

import beatflow
from beatflow import api
from beatflow.errors import InputError


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, beatflow; print(sorted(m for m in ('torch', 'prefect', 'dask', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_docstring_examples():
    assert doctest.testmod(api, raise_on_error=False).failed == 0


def test_read_npy_csv_and_a_wfdb_folder(tmp_path):
    x = np.random.default_rng(0).normal(size=3000).astype(np.float32)
    np.save(tmp_path / "a.npy", x)
    sig = beatflow.read(tmp_path / "a.npy", fs=360)
    assert isinstance(sig, beatflow.Signal) and sig.fs == 360.0 and sig.duration_s == pytest.approx(3000 / 360)
    np.testing.assert_array_equal(sig.values, x)
    pd.DataFrame({"t": np.arange(500), "ecg": x[:500]}).to_csv(tmp_path / "a.csv", index=False)
    sig = beatflow.read(tmp_path / "a.csv", column="ecg")
    np.testing.assert_allclose(sig.values, x[:500], rtol=1e-6)
    import wfdb

    (tmp_path / "db").mkdir()
    for name in ("r1", "r2"):
        wfdb.wrsamp(name, fs=250, units=["mV", "mV"], sig_name=["I", "II"], p_signal=np.c_[x[:1000], -x[:1000]],
                    fmt=["16", "16"], write_dir=str(tmp_path / "db"))
    sigs = beatflow.read(tmp_path / "db", lead=1)
    assert [s.name for s in sigs] == ["r1", "r2"] and all(s.fs == 250 for s in sigs)
    np.testing.assert_allclose(sigs[0].values, -x[:1000], atol=2e-3)


def test_read_rejects_bad_input_with_the_readers_line(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(InputError, match="empty file"):
        beatflow.read(tmp_path / "empty.csv")


def test_options_by_python_name():
    parser = api._run_options()
    argv = api._argv(parser, {"hours": 2, "confirm_lead": 1, "no_service": True, "verbose": False, "fs": None})
    assert argv == ["run", "--hours", "2", "--confirm-lead", "1", "--no-service"]
    with pytest.raises(TypeError, match="unknown option.*hourz"):
        api._argv(parser, {"hourz": 2})


def test_bad_option_values_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="--device.*invalid choice"):
        beatflow.run(device="tpu", out=tmp_path / "o")
    with pytest.raises(InputError, match="--epochs must be positive"):
        beatflow.run(epochs=0, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_run_end_to_end(tmp_path):
    res = beatflow.run(hours=0.1, out=tmp_path / "run", epochs=1, workers=2, no_service=True)
    assert res.report.is_file() and res.report.stat().st_size > 10_000
    assert res.summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(res.beats) == res.summary["beats_kept"] > 100
    assert {"time_s", "class", "score", "flagged"} <= set(res.beats.columns)
    assert set(res.beats["class"]) <= set("NSVFQ")
    assert isinstance(res.quality, pd.DataFrame)
    assert "beats_kept" in repr(res)
