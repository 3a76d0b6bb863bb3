import numpy as np
import pytest

from beatflow.errors import InputError
from beatflow.reading import CsvSource, open_source


def write(path, text):
    path.write_text(text)
    return path


def read_all(src, n):
    return np.concatenate([src.read(sp) for sp in src.plan(n)])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 50])
def test_csv_partitions_cover_every_row_once(tmp_path, n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=1000).astype(np.float32)
    p = tmp_path / "ecg.csv"
    p.write_text("heartbeats\n" + "\n".join(f"{v:.6f}" for v in x) + "\n")
    src = open_source(p)
    assert isinstance(src, CsvSource) and src.column == "heartbeats"
    np.testing.assert_allclose(read_all(src, n), x, atol=1e-6)


def test_csv_column_choice(tmp_path):
    p = write(tmp_path / "two.csv", "time,ecg\n0,1.5\n1,2.5\n2,3.5\n")
    np.testing.assert_array_equal(read_all(open_source(p, column="ecg"), 2), [1.5, 2.5, 3.5])
    with pytest.raises(InputError, match=r"two\.csv: 2 columns \(time, ecg\): choose one with --column"):
        open_source(p)
    with pytest.raises(InputError, match=r"two\.csv: unknown column 'lead' \(columns: time, ecg\)"):
        open_source(p, column="lead")


@pytest.mark.parametrize("text,pattern", [
    ("", "empty file"),
    ("heartbeats\n", "header only, no samples"),
    ("heartbeats\n\n\n", "header only, no samples"),
    ("0.1\n0.2\n", "first line must be a header"),
])
def test_csv_bad_files_at_open(tmp_path, text, pattern):
    p = write(tmp_path / "bad.csv", text)
    with pytest.raises(InputError, match=pattern) as e:
        open_source(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad,line_no,pattern", [
    ("abc", 6, "cannot parse 'abc' as a number"),
    ("nan", 9, "non-finite or missing value 'nan'"),
    ("inf", 3, "non-finite or missing value 'inf'"),
])
@pytest.mark.parametrize("parts", [1, 3])
def test_csv_bad_rows_name_the_line(tmp_path, bad, line_no, pattern, parts):
    rows = [f"{0.01 * i:.3f}" for i in range(40)]
    rows[line_no - 2] = bad
    p = write(tmp_path / "rows.csv", "heartbeats\n" + "\n".join(rows) + "\n")
    src = open_source(p)
    with pytest.raises(InputError) as e:
        read_all(src, parts)
    assert str(e.value) == f"{p}: line {line_no}: {pattern} in column 'heartbeats'"


def test_missing_field_in_two_column_csv(tmp_path):
    p = write(tmp_path / "two.csv", "t,ecg\n0,1.0\n1,\n2,3.0\n")
    with pytest.raises(InputError, match=r"line 3: non-finite or missing value '' in column 'ecg'"):
        read_all(open_source(p, column="ecg"), 1)


def test_missing_paths(tmp_path):
    with pytest.raises(InputError, match="no such file or folder"):
        open_source(tmp_path / "nope.csv")
    with pytest.raises(InputError, match="no WFDB records"):
        open_source(tmp_path)


def test_parquet_and_npy(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.arange(1000, dtype=np.float32)
    pq.write_table(pa.table({"ecg": x, "other": x * 2}), tmp_path / "a.parquet", row_group_size=128)
    src = open_source(tmp_path / "a.parquet", column="ecg", fs=360)
    assert src.fs == 360 and src.recordings[0].n_samples == 1000
    for n in (1, 3, 9):
        np.testing.assert_array_equal(read_all(src, n), x)
    np.save(tmp_path / "b.npy", x)
    np.testing.assert_array_equal(read_all(open_source(tmp_path / "b.npy"), 4), x)
    x[500] = np.nan
    np.save(tmp_path / "c.npy", x)
    with pytest.raises(InputError, match="sample 500: non-finite"):
        read_all(open_source(tmp_path / "c.npy"), 2)


def test_wfdb_folder_partitions_match_rdrecord(mitdb, tmp_path):
    import shutil

    import wfdb

    for ext in ("hea", "dat", "atr"):
        shutil.copy(mitdb / f"101.{ext}", tmp_path)
    src = open_source(tmp_path)
    assert src.fs == 360 and src.recordings[0].n_samples == 650000 and src.recordings[0].name == "101"
    whole = wfdb.rdrecord(str(tmp_path / "101"), channels=[0]).p_signal[:, 0].astype(np.float32)
    np.testing.assert_array_equal(read_all(src, 5), whole)
    with pytest.raises(InputError, match="lead 5 does not exist"):
        open_source(tmp_path, lead=5)
