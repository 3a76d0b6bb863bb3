import bz2
import gzip
import io
import lzma

import numpy as np
import pytest

from beatflow.errors import InputError
from beatflow.params import check_fs
from beatflow.io.sources import CsvSource, open_source


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


def one_line(e, *parts):
    """The error's message: one line, holding each of ``parts``."""
    msg = str(e.value)
    assert "\n" not in msg and "\r" not in msg, msg
    for part in parts:
        assert str(part) in msg, (part, msg)
    return msg


# ---- what a file holds, from its first bytes (open time)

CSV_TEXT = "heartbeats\n" + "\n".join(f"{0.01 * i:.3f}" for i in range(200)) + "\n"


def _zip(text):
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("ecg.csv", text)
    return buf.getvalue()


def _parquet_bytes(text):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"heartbeats": np.arange(10.0)}), buf)
    return buf.getvalue()


def _npy_bytes(text):
    buf = io.BytesIO()
    np.save(buf, np.arange(10.0))
    return buf.getvalue()


@pytest.mark.parametrize("name,make,expected", [
    ("x.csv.gz", lambda t: gzip.compress(t.encode()), "x.csv.gz: gzip-compressed; decompress it first (gunzip {p})"),
    ("x.csv", lambda t: gzip.compress(t.encode()), "x.csv: gzip-compressed; decompress it first (gzip -dc {p} > "),
    ("x.csv.bz2", lambda t: bz2.compress(t.encode()), "x.csv.bz2: bzip2-compressed; decompress it first (bunzip2 {p})"),
    ("x.txt", lambda t: bz2.compress(t.encode()), "x.txt: bzip2-compressed; decompress it first (bzip2 -dc {p} > "),
    ("x.csv.xz", lambda t: lzma.compress(t.encode()), "x.csv.xz: xz-compressed; decompress it first (unxz {p})"),
    ("x.csv.zst", lambda t: b"\x28\xb5\x2f\xfd" + bytes(64),
     "x.csv.zst: zstd-compressed; decompress it first (unzstd {p})"),
    ("x.zip", _zip, "x.zip: a zip archive; decompress it first (unzip {p})"),
    ("x.csv", _zip, "x.csv: a zip archive; decompress it first (unzip -p {p} > "),
    ("x.csv", _parquet_bytes, "x.csv: a Parquet file (PAR1 magic) under another suffix; rename it to x.parquet"),
    ("x.dat", _npy_bytes, "x.dat: a NumPy .npy array under another suffix; rename it to x.npy"),
    ("x.csv", lambda t: t.encode()[:40] + b"\x00\x01\x02\xff" + t.encode(),
     "x.csv: binary data (a NUL byte at offset 40, in b'\\n0.030\\n0.040\\x00\\x01\\x02\\xffheartbea'), not a text CSV"),
    ("x.csv", lambda t: bytes(range(256)) * 4, "x.csv: binary data (a NUL byte at offset 0, in b'\\x00\\x01"),
    ("x.csv", lambda t: t.encode("utf-16"), "x.csv: UTF-16 text; save it as UTF-8"),
    ("x.csv.gz", lambda t: t.encode(), "x.csv.gz: named .gz but not gzip-compressed (starts with b'heartbeats"),
])
def test_file_magic_refused_at_open(tmp_path, name, make, expected):
    p = tmp_path / name
    p.write_bytes(make(CSV_TEXT))
    with pytest.raises(InputError) as e:
        open_source(p)
    assert one_line(e).startswith(str(tmp_path / expected.format(p=p)))


@pytest.mark.parametrize("name,make,expected", [
    ("a.parquet", lambda t: t.encode(),
     "a.parquet: not a Parquet file (no PAR1 magic at the start; starts with b'heartbeats"),
    ("a.parquet", lambda t: _parquet_bytes(t)[:-30], "a.parquet: not a complete Parquet file (no PAR1 magic at the end"),
    ("a.pq", lambda t: b"PAR1", "a.pq: not a complete Parquet file (no PAR1 magic at the end"),
    ("a.parquet", _npy_bytes, "a.parquet: a NumPy .npy array under another suffix; rename it to a.npy"),
    ("a.npy", lambda t: t.encode(),
     "a.npy: not a .npy array (no \\x93NUMPY magic; starts with b'heartbeats"),
    ("a.npy", _parquet_bytes, "a.npy: a Parquet file (PAR1 magic) under another suffix; rename it to a.parquet"),
    ("a.npy", lambda t: gzip.compress(_npy_bytes(t)), "a.npy: gzip-compressed; decompress it first"),
])
def test_parquet_and_npy_magic(tmp_path, name, make, expected):
    p = tmp_path / name
    p.write_bytes(make(CSV_TEXT))
    with pytest.raises(InputError) as e:
        open_source(p)
    assert one_line(e).startswith(str(tmp_path / expected))


@pytest.mark.parametrize("header", ["heartbeats", "t,heartbeats", '"t","heartbeats"'])
@pytest.mark.parametrize("nl", ["\n", "\r\n"])
def test_csv_byte_order_mark_is_no_part_of_the_header(tmp_path, header, nl):
    ncol = header.count(",") + 1
    rows = [",".join([str(i)] * (ncol - 1) + [f"{0.5 * i:.1f}"]) for i in range(30)]
    p = tmp_path / "bom.csv"
    p.write_bytes(("\ufeff" + nl.join([header, *rows]) + nl).encode("utf-8"))
    src = open_source(p, column="heartbeats")
    assert src.column == "heartbeats" and src.names[-1] == "heartbeats"
    np.testing.assert_array_equal(read_all(src, 3), 0.5 * np.arange(30))
    if ncol == 1:
        assert open_source(p).column == "heartbeats"
    rows[20] = ",".join(rows[20].split(",")[:-1] + ["abc"])  # file line 22, the header being line 1
    p.write_bytes(("\ufeff" + nl.join([header, *rows]) + nl).encode("utf-8"))
    with pytest.raises(InputError) as e:
        read_all(open_source(p, column="heartbeats"), 3)
    assert one_line(e) == f"{p}: line 22: cannot parse 'abc' as a number in column 'heartbeats'"


# ---- Parquet column types (open time) and values (read time)

TO_FLOAT = "; convert the column to a float type"


@pytest.mark.parametrize("values,expected", [
    (["0.12", "-3.5", "7"], "holds numbers stored as text (type string, e.g. '0.12')" + TO_FLOAT),
    (("large_string", ["1e-3", "2"]), "holds numbers stored as text (type large_string, e.g. '1e-3')" + TO_FLOAT),
    (("dictionary", ["0.5", "0.25"]), "holds numbers stored as text (type string, e.g. '0.5')" + TO_FLOAT),
    (["0.1", "n/a", "0.3"], "is not numeric (type string, e.g. 'n/a')"),
    (["abc"] * 3, "is not numeric (type string, e.g. 'abc')"),
    (["x" * 60], f"is not numeric (type string, e.g. {'x' * 40!r})"),
    ([True, False, True], "holds true/false values (type bool), not numeric samples"),
    (("timestamp", [1, 2, 3]), "has type timestamp[ms], not a numeric type"),  # Parquet keeps ms
    (("list", [[1.0], [2.0]]), "has type list<element: double>, not a numeric type"),
])
def test_parquet_non_numeric_column_refused_at_open(tmp_path, values, expected):
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind, values = values if isinstance(values, tuple) else (None, values)
    arr = {None: lambda v: pa.array(v), "large_string": lambda v: pa.array(v, pa.large_string()),
           "dictionary": lambda v: pa.array(v).dictionary_encode(),
           "timestamp": lambda v: pa.array(v, pa.timestamp("s")), "list": lambda v: pa.array(v)}[kind](values * 20)
    p = tmp_path / "s.parquet"
    pq.write_table(pa.table({"t": np.arange(len(arr)), "ecg": arr}), p, row_group_size=16)
    with pytest.raises(InputError) as e:
        open_source(p, column="ecg")
    assert one_line(e) == f"{p}: column 'ecg' {expected}"


@pytest.mark.parametrize("arrow_type", ["int16", "uint32", "int64", "float16", "float32", "float64", "decimal"])
def test_parquet_numeric_types_are_read(tmp_path, arrow_type):
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.arange(100)
    arr = (pa.array([decimal.Decimal(int(v)) for v in x], pa.decimal128(12, 3)) if arrow_type == "decimal"
           else pa.array(x.astype(arrow_type)))
    pq.write_table(pa.table({"ecg": arr}), tmp_path / "n.parquet", row_group_size=30)
    np.testing.assert_array_equal(read_all(open_source(tmp_path / "n.parquet"), 3), x.astype(np.float32))


@pytest.mark.parametrize("bad,row,expected", [
    (None, 5, "missing value (null)"),
    (None, 95, "missing value (null)"),
    (float("nan"), 40, "non-finite value nan"),
    (float("-inf"), 77, "non-finite value -inf"),
    (1e300, 61, "out-of-range value 1e+300"),
    (-1e39, 2, "out-of-range value -1e+39"),
])
@pytest.mark.parametrize("parts", [1, 3])
def test_parquet_bad_values_name_the_row(tmp_path, bad, row, expected, parts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = [float(i) for i in range(100)]
    x[row - 1] = bad  # rows are 1-based
    p = tmp_path / "v.parquet"
    pq.write_table(pa.table({"ecg": pa.array(x, pa.float64())}), p, row_group_size=16)
    with pytest.raises(InputError) as e:
        read_all(open_source(p), parts)
    assert one_line(e).startswith(f"{p}: row {row}: {expected} in column 'ecg'")


def test_npy_values_out_of_float32_range(tmp_path):
    x = np.arange(100.0)
    x[63] = -1e300
    np.save(tmp_path / "a.npy", x)
    with pytest.raises(InputError) as e:
        read_all(open_source(tmp_path / "a.npy"), 3)
    assert one_line(e).startswith(f"{tmp_path / 'a.npy'}: sample 63: out-of-range value -1e+300")
    np.save(tmp_path / "s.npy", np.array(["0.1", "0.2"]))
    with pytest.raises(InputError) as e:
        open_source(tmp_path / "s.npy")
    one_line(e, "s.npy: dtype <U3, not a numeric array")


# ---- WFDB signal files and header (open time)

def _write_record(folder, fmt="16", fs=360, n=3600, name="rec"):
    import wfdb

    folder.mkdir(exist_ok=True)
    sig = np.stack([np.sin(np.arange(n) / 20), 0.5 * np.cos(np.arange(n) / 30)], axis=1)
    wfdb.wrsamp(name, fs=fs, units=["mV", "mV"], sig_name=["a", "b"], p_signal=sig, fmt=[fmt, fmt],
                write_dir=str(folder))
    return folder / f"{name}.dat"


@pytest.mark.parametrize("target", ["folder", "rec.hea", "rec"])
def test_wfdb_missing_signal_file(tmp_path, target):
    dat = _write_record(tmp_path / "db")
    assert open_source(tmp_path / "db").recordings[0].n_samples == 3600
    dat.unlink()
    with pytest.raises(InputError) as e:
        open_source(tmp_path / "db" if target == "folder" else tmp_path / "db" / target)
    assert one_line(e) == f"{tmp_path / 'db' / 'rec.hea'}: signal file rec.dat is missing"


@pytest.mark.parametrize("fmt,n,bytes_per_2", [("16", 3600, 4), ("212", 3601, 3), ("80", 3600, 2), ("24", 3602, 6),
                                               ("32", 3600, 8)])
@pytest.mark.parametrize("cut", [1, 1000])
def test_wfdb_truncated_signal_file(tmp_path, fmt, n, bytes_per_2, cut):
    dat = _write_record(tmp_path / "db", fmt=fmt, n=n)
    need = n * bytes_per_2  # two signals in the file
    assert dat.stat().st_size == need
    np.testing.assert_array_equal(read_all(open_source(tmp_path / "db"), 2).shape, (n,))
    with open(dat, "r+b") as f:
        f.truncate(need - cut)
    with pytest.raises(InputError) as e:
        open_source(tmp_path / "db")
    assert one_line(e) == (f"{dat}: {need - cut} bytes, the header needs {n} samples x 2 signals in format {fmt} "
                           f"({need} bytes)")


def test_wfdb_mitdb_header_without_its_signal_file(mitdb, tmp_path):
    import shutil

    shutil.copy(mitdb / "101.hea", tmp_path)
    with pytest.raises(InputError) as e:
        open_source(tmp_path)
    assert one_line(e) == f"{tmp_path / '101.hea'}: signal file 101.dat is missing"
    (tmp_path / "101.dat").write_bytes((mitdb / "101.dat").read_bytes()[:1200])
    with pytest.raises(InputError) as e:
        open_source(tmp_path / "101")
    assert one_line(e) == (f"{tmp_path / '101.dat'}: 1200 bytes, the header needs 650000 samples x 2 signals "
                           "in format 212 (1950000 bytes)")


@pytest.mark.parametrize("fs", [10, 30000])
def test_wfdb_header_sampling_rate_checked(tmp_path, fs):
    _write_record(tmp_path / "db", fs=fs)
    with pytest.raises(InputError) as e:
        open_source(tmp_path / "db")
    assert one_line(e) == f"{tmp_path / 'db' / 'rec.hea'}: {check_fs(fs)}"


# ---- --fs (open time, before the input is looked at)

@pytest.mark.parametrize("fs", [float("inf"), float("-inf"), float("nan"), 1e9, 0, -1, 49.9, 20001])
@pytest.mark.parametrize("kind", ["csv", "wfdb", "missing"])
def test_bad_sampling_rate_refused_at_open(tmp_path, fs, kind):
    p = {"csv": lambda: write(tmp_path / "a.csv", CSV_TEXT), "wfdb": lambda: _write_record(tmp_path / "db").parent,
         "missing": lambda: tmp_path / "nope.csv"}[kind]()
    with pytest.raises(InputError) as e:
        open_source(p, fs=fs)
    assert one_line(e) == f"--fs {fs:g}: sampling rate must be between 50 and 20000 Hz, got {float(fs)}"
    assert check_fs(float(fs)) in str(e.value)


def test_good_sampling_rates_pass(tmp_path):
    p = write(tmp_path / "a.csv", CSV_TEXT)
    for fs in (50, 128, 360.0, 20000):
        assert open_source(p, fs=fs).fs == fs


# ---- CSV values (read time, on the workers): the line that holds the value, and the value

CSV_BAD_VALUES = [
    ("1e300", "out-of-range value '1e300' in column 'heartbeats' (float32 holds up to ±3.4e38)"),
    ("-1e39", "out-of-range value '-1e39' in column 'heartbeats' (float32 holds up to ±3.4e38)"),
    ("3.5e38", "out-of-range value '3.5e38' in column 'heartbeats' (float32 holds up to ±3.4e38)"),
    ("1e400", "out-of-range value '1e400' in column 'heartbeats' (float32 holds up to ±3.4e38)"),
    ("1,5", "2 fields where the header has 1 (a decimal comma?): '1,5'"),
    ("-0,25", "2 fields where the header has 1 (a decimal comma?): '-0,25'"),
    ("1;2;3", "cannot parse '1;2;3' as a number in column 'heartbeats'"),
    ("inf", "non-finite or missing value 'inf' in column 'heartbeats'"),
    ("-Infinity", "non-finite or missing value '-Infinity' in column 'heartbeats'"),
    ("nan", "non-finite or missing value 'nan' in column 'heartbeats'"),
    ("NA", "non-finite or missing value 'NA' in column 'heartbeats'"),
    ('""', "non-finite or missing value '' in column 'heartbeats'"),
    ("abc", "cannot parse 'abc' as a number in column 'heartbeats'"),
    ("0x10", "cannot parse '0x10' as a number in column 'heartbeats'"),
    ("y" * 60, f"cannot parse {'y' * 40!r} as a number in column 'heartbeats'"),
]


@pytest.mark.parametrize("bad,expected", CSV_BAD_VALUES)
@pytest.mark.parametrize("line_no", [3, 31, 60])
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("nl", ["\n", "\r\n"])
def test_csv_bad_value_names_its_line_and_value(tmp_path, bad, expected, line_no, parts, nl):
    # file lines, the header being line 1: a quoted value on line 7 and a blank line on line 12 count
    lines = ["heartbeats", *(f"{0.01 * i:.3f}" for i in range(60))]
    lines[6], lines[11] = '"0.5"', ""
    lines[line_no - 1] = bad
    p = tmp_path / "rows.csv"
    p.write_bytes((nl.join(lines) + nl).encode())
    src = open_source(p)
    if parts == 3:
        assert len(src.plan(parts)) == 3
    with pytest.raises(InputError) as e:
        read_all(src, parts)
    assert one_line(e, bad.strip('"')[:40]) == f"{p}: line {line_no}: {expected}"


@pytest.mark.parametrize("bad_line,expected", [
    ("5,", "non-finite or missing value '' in column 'ecg'"),
    ("5,1e300", "out-of-range value '1e300' in column 'ecg' (float32 holds up to ±3.4e38)"),
    ("5,1,5", "3 fields where the header has 2 (a decimal comma?): '5,1,5'"),
    ("5", "1 field where the header has 2: '5'"),
    ('5,"abc"', "cannot parse 'abc' as a number in column 'ecg'"),
])
def test_csv_bad_value_in_a_two_column_file(tmp_path, bad_line, expected):
    lines = ["t,ecg", *(f"{i},{0.1 * i:.1f}" for i in range(50))]
    lines[44] = bad_line
    p = write(tmp_path / "two.csv", "\n".join(lines) + "\n")
    with pytest.raises(InputError) as e:
        read_all(open_source(p, column="ecg"), 4)
    assert one_line(e) == f"{p}: line 45: {expected}"


def test_sources_pickle(tmp_path, mitdb):
    import pickle
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copy(mitdb / "101.hea", tmp_path)
    shutil.copy(mitdb / "101.dat", tmp_path)
    pq.write_table(pa.table({"ecg": np.arange(50.0)}), tmp_path / "a.parquet")
    np.save(tmp_path / "a.npy", np.arange(50.0))
    for p in (write(tmp_path / "a.csv", CSV_TEXT), tmp_path / "a.parquet", tmp_path / "a.npy", tmp_path / "101"):
        src = open_source(p)
        again = pickle.loads(pickle.dumps(src))
        assert again == src
        spec = src.plan(3)[1]
        np.testing.assert_array_equal(again.read(spec), src.read(spec))


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
