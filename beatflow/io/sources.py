"""Reading ECG streams: one-column CSV, Parquet, WFDB records, EDF/EDF+/BDF files (:mod:`beatflow.io.edf`),
each alone or a folder of them, and ``.npy`` (synthetic).

A source is opened and checked once (cheaply: headers and metadata), then planned into partitions
that workers read independently, so no process holds the whole stream. Every problem is an
:class:`~beatflow.errors.InputError` whose message is one line naming the file.
"""
from __future__ import annotations

import csv
import io
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from beatflow.errors import InputError
from beatflow.io.channels import Lead, describe, pick_channel
from beatflow.io.edf import BDF_MAGIC, EDF_SUFFIXES, EdfChannel, looks_like_edf, open_channel, read_channel
from beatflow.params import DEFAULT_FS, check_fs

F32_MAX = float(np.finfo(np.float32).max)
# how much of a file is read at open to recognise what it holds (magic numbers, NUL bytes, BOM)
_SNIFF_BYTES = 8192
# a header line longer than this is no CSV header (and reading on would read a whole binary file)
_MAX_HEADER_BYTES = 1 << 20
# compressed and archive formats an input file may hold: (magic, what it is, suffix, command that
# decompresses in place, command that decompresses to stdout); partitions are byte ranges (CSV) or
# row groups and memory maps of the file, so compressed input is refused rather than read
_COMPRESSED = (
    (b"\x1f\x8b", "gzip-compressed", ".gz", "gunzip", "gzip -dc"),
    (b"BZh", "bzip2-compressed", ".bz2", "bunzip2", "bzip2 -dc"),
    (b"\xfd7zXZ\x00", "xz-compressed", ".xz", "unxz", "xz -dc"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", ".zst", "unzstd", "zstd -dc"),
    (b"PK\x03\x04", "a zip archive", ".zip", "unzip", "unzip -p"),
)
_COMPRESSED_SUFFIXES = {c[2] for c in _COMPRESSED}
_PARQUET_MAGIC = b"PAR1"
_NPY_MAGIC = b"\x93NUMPY"
# bytes a sample takes in each WFDB signal file format, as (numerator, denominator): 212 packs two
# 12-bit samples in 3 bytes, 310/311 three 10-bit samples in 4; the FLAC formats (508, 516, 524) are
# compressed and cannot be sized from the header
_WFDB_BYTES = {"8": (1, 1), "16": (2, 1), "24": (3, 1), "32": (4, 1), "61": (2, 1), "80": (1, 1),
               "160": (2, 1), "212": (3, 2), "310": (4, 3), "311": (4, 3)}


@dataclass(frozen=True)
class Recording:
    """One continuous recording of a source (a WFDB record, or the single stream of a file)."""

    name: str
    fs: float
    n_samples: int | None  # None for CSV until its partitions are read


@dataclass(frozen=True)
class PartitionSpec:
    """Where a partition lies: recording, ordinal, and a ``[start, stop)`` range (bytes for CSV,
    samples otherwise)."""

    recording: int
    index: int
    start: int
    stop: int


def _split_even(n_items: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n_items)) if n_items > 0 else 1
    edges = [round(k * n_items / parts) for k in range(parts + 1)]
    return [(edges[k], edges[k + 1]) for k in range(parts) if edges[k + 1] > edges[k]] or [(0, 0)]


def _check_values(values: np.ndarray, where, column: str | None = None) -> np.ndarray:
    """``values`` as float32, or an :class:`InputError` at the first one that is no finite float32.

    The check runs on the values as stored (float64, say) so that a value too large for float32 is
    reported as itself, not as the ``inf`` the cast would make of it.

    Parameters
    ----------
    values : ndarray
        Numeric values as read.
    where : callable
        ``where(i)``: the message's prefix (file and sample or row) for the ``i``-th value.
    column : str, optional
        The column the values come from, to name in the message.
    """
    if values.dtype.kind == "f" and values.size:
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(values)
            if values.dtype.itemsize > 4:
                bad |= np.abs(values) > F32_MAX
        if bad.any():
            i = int(np.argmax(bad))
            v = float(values[i])
            in_column = f" in column {column!r}" if column is not None else ""
            problem = (f"non-finite value {v!r}{in_column}" if not math.isfinite(v)
                       else f"out-of-range value {v!r}{in_column} (float32 holds up to ±3.4e38)")
            raise InputError(f"{where(i)}: {problem}")
    return np.asarray(values, dtype=np.float32)


def _sniff(p: Path, head: bytes) -> str | None:
    """What ``head`` (a file's first bytes) says the file is, with what to do about it, when it is
    compressed or an archive; None otherwise."""
    name = shlex.quote(str(p))
    for magic, what, suffix, unpack, to_stdout in _COMPRESSED:
        if head.startswith(magic):
            if suffix == ".zip" and p.suffix.lower() in (".xlsx", ".xlsm", ".ods"):
                return f"{p}: a spreadsheet, not a CSV file; export the sheet as CSV"
            if p.suffix.lower() == suffix:
                return f"{p}: {what}; decompress it first ({unpack} {name})"
            out = shlex.quote(str(p.with_name(p.stem + "-decompressed" + p.suffix)))
            return f"{p}: {what}; decompress it first ({to_stdout} {name} > {out})"
    return None


def _head(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(_SNIFF_BYTES)


@dataclass(frozen=True)
class Source:
    """Base: a path and its recordings."""

    path: str
    recordings: tuple[Recording, ...]

    @property
    def fs(self) -> float:
        return self.recordings[0].fs

    @property
    def kind(self) -> str:
        return type(self).__name__.replace("Source", "").lower()

    def plan(self, n_partitions: int) -> list[PartitionSpec]:
        """Cut every recording into partitions, about ``n_partitions`` in all (at least one each)."""
        total = sum(r.n_samples for r in self.recordings)
        specs = []
        for ri, rec in enumerate(self.recordings):
            parts = max(1, round(n_partitions * rec.n_samples / max(total, 1)))
            for k, (a, b) in enumerate(_split_even(rec.n_samples, parts)):
                specs.append(PartitionSpec(ri, k, a, b))
        return specs

    def read(self, spec: PartitionSpec) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class NpySource(Source):
    """A float ``.npy`` stream (what the synthetic generator writes)."""

    def read(self, spec: PartitionSpec) -> np.ndarray:
        x = np.load(self.path, mmap_mode="r")
        return _check_values(np.asarray(x[spec.start : spec.stop]), lambda i: f"{self.path}: sample {spec.start + i}")


@dataclass(frozen=True)
class ParquetSource(Source):
    """One column of a Parquet file, read by row groups."""

    column: str = ""

    def read(self, spec: PartitionSpec) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        pieces, row0 = [], 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            lo, hi = max(spec.start, row0), min(spec.stop, row0 + n)
            if lo < hi:
                col = pf.read_row_group(g, columns=[self.column]).column(0).slice(lo - row0, hi - lo)
                if col.null_count:  # rows are 1-based, as a spreadsheet shows them
                    i = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
                    raise InputError(f"{self.path}: row {lo + i + 1}: missing value (null) in column {self.column!r}")
                try:  # ints and decimals through float64, so that the range check sees the true value
                    if not pa.types.is_floating(col.type):
                        col = pc.cast(col, pa.float64())
                    pieces.append(col.to_numpy())
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
                    msg = f"{self.path}: column {self.column!r} is not numeric ({e})"
                    raise InputError(msg.splitlines()[0]) from None
            row0 += n
        out = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        return _check_values(out, lambda i: f"{self.path}: row {spec.start + i + 1}", self.column)


@dataclass(frozen=True)
class WfdbSource(Source):
    """A folder of WFDB records (``.hea`` + signal files), one channel (``lead``: an index, or a label
    of the headers' signal names) of each: ``channels[k]`` in record ``k``."""

    lead: Lead = 0
    record_paths: tuple[str, ...] = field(default=())
    channels: tuple[int, ...] = field(default=())

    def read(self, spec: PartitionSpec) -> np.ndarray:
        import wfdb

        rec_path = self.record_paths[spec.recording]
        channel = self.channels[spec.recording] if self.channels else int(self.lead)
        try:
            rec = wfdb.rdrecord(rec_path, sampfrom=spec.start, sampto=spec.stop, channels=[channel])
        except Exception as e:  # wfdb raises many kinds
            raise InputError(f"{rec_path}: cannot read WFDB record ({type(e).__name__}: {e})".splitlines()[0]) from None
        return _check_values(np.asarray(rec.p_signal[:, 0]), lambda i: f"{rec_path}: sample {spec.start + i}")


@dataclass(frozen=True)
class EdfSource(Source):
    """EDF/EDF+/BDF files (one, or a folder of them), one channel of each (``lead``: an index or a
    label): ``files[k]`` is recording ``k``'s channel, read by sample range with pyedflib."""

    lead: Lead = 0
    files: tuple[EdfChannel, ...] = field(default=())

    @property
    def channels(self) -> tuple[int, ...]:
        return tuple(f.channel for f in self.files)

    def read(self, spec: PartitionSpec) -> np.ndarray:
        ch = self.files[spec.recording]
        return _check_values(read_channel(ch, spec.start, spec.stop),
                             lambda i: f"{ch.path}: channel {describe(ch.label)}: sample {spec.start + i}")


def _csv_fields(line: str) -> list[str]:
    """The fields of one CSV line (quotes as pyarrow reads them)."""
    return next(csv.reader([line]), [])


def _float_text(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


@dataclass(frozen=True)
class CsvSource(Source):
    """One column of a CSV file with a header line, partitioned by byte ranges at line breaks."""

    column: str = ""
    names: tuple[str, ...] = ()
    data_start: int = 0  # byte offset of the first data line

    def plan(self, n_partitions: int) -> list[PartitionSpec]:
        size = os.path.getsize(self.path)
        span = size - self.data_start
        cuts = [self.data_start]
        with open(self.path, "rb") as f:
            for k in range(1, max(1, n_partitions)):
                f.seek(self.data_start + k * span // n_partitions)
                f.readline()
                pos = f.tell()
                if cuts[-1] < pos < size:
                    cuts.append(pos)
        cuts.append(size)
        return [PartitionSpec(0, k, a, b) for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]

    def _parse(self, data: bytes):
        """The chosen column of ``data`` (whole lines) as float32, or the pyarrow error."""
        import pyarrow as pa
        import pyarrow.csv as pcsv

        if not data.strip(b"\r\n"):  # blank lines only: pyarrow would call it an empty file
            return np.zeros(0, np.float32), None
        try:
            table = pcsv.read_csv(
                io.BytesIO(data),
                read_options=pcsv.ReadOptions(column_names=list(self.names)),
                convert_options=pcsv.ConvertOptions(column_types={self.column: pa.float32()},
                                                    include_columns=[self.column]),
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            return None, e
        # nulls (empty fields, 'NA') arrive as NaN; a value beyond float32's range as ±inf
        return table.column(0).to_numpy(zero_copy_only=False), None

    def _lines_before(self, spec: PartitionSpec) -> int:
        """File lines before the partition (the header and the data lines of earlier partitions)."""
        before = 1
        with open(self.path, "rb") as f:
            f.seek(self.data_start)
            remaining = spec.start - self.data_start
            while remaining > 0:
                block = f.read(min(remaining, 1 << 24))
                before += block.count(b"\n")
                remaining -= len(block)
        return before

    def _first_bad_line(self, chunk: bytes) -> tuple[int, bytes, Exception | None]:
        """0-based index in ``chunk``, text and pyarrow error (None where it parsed, to a non-finite
        value) of the first line that does not parse to a finite float32.

        Lines are independent to pyarrow (a field cannot span lines), so bisecting the chunk's lines
        with pyarrow itself finds the line it stumbles on, whatever the cause: about two parses of
        the chunk in all. Only the error path runs this.
        """
        ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")) + 1
        bounds = [0, *ends.tolist()]
        if bounds[-1] < len(chunk):
            bounds.append(len(chunk))

        def bad(a: int, b: int) -> tuple[bool, Exception | None]:
            values, err = self._parse(chunk[bounds[a] : bounds[b]])
            return err is not None or not np.isfinite(values).all(), err

        lo, hi = 0, len(bounds) - 1  # the first bad line lies in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if bad(lo, mid)[0]:
                hi = mid
            else:
                lo = mid
        return lo, chunk[bounds[lo] : bounds[lo + 1]], bad(lo, lo + 1)[1]

    def _problem(self, text: str, err: Exception | None) -> str:
        """What is wrong with one data line: ``problem 'value' in column 'name'``."""
        fields = _csv_fields(text)
        if len(fields) != len(self.names):
            # '1,5' in a one-column file: a decimal comma splits a value into two fields
            comma = len(fields) > len(self.names) and any(
                re.fullmatch(r"\s*[+-]?\d+", a) and re.fullmatch(r"\d+([eE][+-]?\d+)?\s*", b)
                for a, b in zip(fields, fields[1:]))
            return (f"{len(fields)} field{'s' * (len(fields) != 1)} where the header has {len(self.names)}"
                    f"{' (a decimal comma?)' if comma else ''}: {text[:40]!r}")
        value = fields[self.names.index(self.column)].strip()
        shown = f"{value[:40]!r} in column {self.column!r}"
        v = _float_text(value)
        # 'inf' is written as such; a float64 overflow ('1e400') is out of range, below
        nonfinite = v is not None and (math.isnan(v) or (math.isinf(v) and "inf" in value.lower()))
        if value in _csv_null_values() or nonfinite:
            return f"non-finite or missing value {shown}"
        with np.errstate(over="ignore"):
            if v is not None and not np.isfinite(np.float32(v)):
                return f"out-of-range value {shown} (float32 holds up to ±3.4e38)"
        # what Python reads but pyarrow does not ('1_000') is unparsable too
        reason = f" ({str(err).splitlines()[0][:80]})" if err is not None and v is not None else ""
        return f"cannot parse {value[:40]!r} as a number in column {self.column!r}{reason}"

    def read(self, spec: PartitionSpec) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(spec.start)
            chunk = f.read(spec.stop - spec.start)
        out, err = self._parse(chunk)
        if err is None and np.isfinite(out).all():
            return out.astype(np.float32, copy=False)
        k, line, err = self._first_bad_line(chunk)
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        raise InputError(f"{self.path}: line {self._lines_before(spec) + k + 1}: {self._problem(text, err)}")


def _csv_null_values() -> frozenset[str]:
    """The texts pyarrow reads as a missing value (``''``, ``NA``, ``null``...)."""
    import pyarrow.csv as pcsv

    return frozenset(pcsv.ConvertOptions().null_values)


def _choose_column(path: Path, names, column: str | None) -> str:
    """The column to read of a CSV/Parquet file with ``names``: ``column``, or the only one."""
    if column is None:
        if len(names) != 1:
            raise InputError(f"{path}: {len(names)} columns ({', '.join(names)}): choose one with --column")
        return names[0]
    if column not in names:
        raise InputError(f"{path}: unknown column {column!r} (columns: {', '.join(names)})")
    return column


def _open_csv(path: Path, column: str | None, fs: float, head: bytes) -> CsvSource:
    if b"\x00" in head:
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise InputError(f"{path}: UTF-16 text; save it as UTF-8 (starts with {head[:16]!r})")
        i = head.index(0)
        raise InputError(f"{path}: binary data (a NUL byte at offset {i}, in {head[max(0, i - 12) : i + 12]!r}), "
                         f"not a text CSV")
    with open(path, "rb") as f:
        header = f.readline(_MAX_HEADER_BYTES)
        if len(header) == _MAX_HEADER_BYTES and not header.endswith(b"\n"):
            raise InputError(f"{path}: the first line is over {_MAX_HEADER_BYTES >> 20} MiB long, not a CSV header; "
                             f"starts with {header[:40]!r}")
        data_start = f.tell()
        first = f.readline(_MAX_HEADER_BYTES)
        while first and not first.strip():
            first = f.readline(_MAX_HEADER_BYTES)
    # utf-8-sig: a byte-order mark (Excel writes one) is no part of the first column's name; the
    # offsets stay those of the bytes
    text = header.decode("utf-8-sig", errors="replace").strip()
    names = [h.strip().strip('"') for h in _csv_fields(text)]
    if not text:
        raise InputError(f"{path}: empty file")
    if not first:
        raise InputError(f"{path}: header only, no samples")
    column = _choose_column(path, names, column)
    if _float_text(column) is not None:
        raise InputError(f"{path}: the first line must be a header naming the columns, got {text[:40]!r}")
    return CsvSource(str(path), (Recording(path.stem, fs, None),), column=column, names=tuple(names),
                     data_start=data_start)


def _text_sample(pf, column: str, n: int = 20) -> list[str]:
    """Up to ``n`` non-null values of a text column, from the start of its first row group."""
    batch = next(pf.iter_batches(batch_size=n, columns=[column]), None)
    values = batch.column(0).to_pylist() if batch is not None else []
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in values if v is not None]


def _check_parquet_type(path: Path, pf, column: str) -> None:
    """Refuse a column whose Arrow type is no number (ints, floats and decimals are)."""
    import pyarrow as pa

    t = pf.schema_arrow.field(column).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return
    if pa.types.is_boolean(t):
        raise InputError(f"{path}: column {column!r} holds true/false values (type bool), not numeric samples")
    if pa.types.is_null(t):
        raise InputError(f"{path}: column {column!r} holds only nulls (type null), no samples")
    text = (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or str(t) in ("string_view", "binary_view"))
    if text:
        sample = _text_sample(pf, column)
        if sample and all(_float_text(v) is not None for v in sample):
            raise InputError(f"{path}: column {column!r} holds numbers stored as text (type {t}, e.g. "
                             f"{sample[0][:40]!r}); convert the column to a float type")
        odd = next((v for v in sample if _float_text(v) is None), "")
        raise InputError(f"{path}: column {column!r} is not numeric (type {t}, e.g. {odd[:40]!r})")
    raise InputError(f"{path}: column {column!r} has type {t}, not a numeric type")


def _open_parquet(path: Path, column: str | None, fs: float, head: bytes) -> ParquetSource:
    import pyarrow.parquet as pq

    # a Parquet file starts and ends with PAR1; a missing end is a truncated file
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - len(_PARQUET_MAGIC)))
        tail = f.read()
    if not head.startswith(_PARQUET_MAGIC):
        raise InputError(f"{path}: not a Parquet file (no PAR1 magic at the start; starts with {head[:16]!r})")
    if len(head) < 2 * len(_PARQUET_MAGIC) or tail != _PARQUET_MAGIC:
        raise InputError(f"{path}: not a complete Parquet file (no PAR1 magic at the end: truncated?; "
                         f"ends with {tail!r})")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})".splitlines()[0]) from None
    names = pf.schema_arrow.names
    column = _choose_column(path, names, column)
    n = pf.metadata.num_rows
    if n == 0:
        raise InputError(f"{path}: no samples")
    _check_parquet_type(path, pf, column)
    return ParquetSource(str(path), (Recording(path.stem, fs, n),), column=column)


def _open_npy(path: Path, fs: float, head: bytes) -> NpySource:
    if not head.startswith(_NPY_MAGIC):
        raise InputError(f"{path}: not a .npy array (no \\x93NUMPY magic; starts with {head[:16]!r})")
    try:
        arr = np.load(path, mmap_mode="r")
    except Exception as e:
        raise InputError(f"{path}: not a readable .npy array ({e})".splitlines()[0]) from None
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise InputError(f"{path}: expected a non-empty 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise InputError(f"{path}: dtype {arr.dtype}, not a numeric array (ints or floats)")
    return NpySource(str(path), (Recording(path.stem, fs, int(arr.shape[0])),))


def _check_wfdb_files(h: Path, hdr) -> None:
    """Refuse a record whose header names a signal file that is missing or shorter than the header
    says (``os.path.getsize`` only: the samples are read by the workers)."""
    names = getattr(hdr, "file_name", None)  # a multi-segment header names segments, not files
    if not names:
        return
    files: dict[str, list] = {}  # file -> [format, byte offset, samples a frame, signals]
    for i, name in enumerate(names):
        fmt = str(hdr.fmt[i]) if hdr.fmt else ""
        offset = (hdr.byte_offset[i] if hdr.byte_offset else None) or 0
        spf = (hdr.samps_per_frame[i] if hdr.samps_per_frame else None) or 1
        entry = files.setdefault(name, [fmt, int(offset), 0, 0])
        entry[2] += int(spf)
        entry[3] += 1
    for name, (fmt, offset, spf, n_sig) in files.items():
        if name == "-":  # standard input: nothing to check
            continue
        fp = h.parent / name
        if not fp.is_file():
            raise InputError(f"{h}: signal file {name} is missing")
        if fmt not in _WFDB_BYTES:  # FLAC (508, 516, 524) or unknown: not sizable from the header
            continue
        num, den = _WFDB_BYTES[fmt]
        need = offset + -(-int(hdr.sig_len) * spf * num // den)
        size = os.path.getsize(fp)
        if size < need:
            shape = (f"{hdr.sig_len} samples x {n_sig} signal{'s' * (n_sig != 1)}" if spf == n_sig
                     else f"{hdr.sig_len} frames x {spf} samples ({n_sig} signals)")
            extra = f" + {offset} header bytes" if offset else ""
            raise InputError(f"{fp}: {size} bytes, the header needs {shape} in format {fmt}{extra} ({need} bytes)")


def _folder_kind(path: Path) -> str:
    """What a folder input holds: ``"wfdb"`` (``.hea`` files) or ``"edf"`` (``.edf``/``.bdf`` files)."""
    heads = any(path.glob("*.hea"))
    edfs = any(p.suffix.lower() in EDF_SUFFIXES for p in path.iterdir() if p.is_file())
    if heads and edfs:
        raise InputError(f"{path}: holds both WFDB records (.hea) and EDF/BDF files; put each kind in a folder "
                         f"of its own")
    if not heads and not edfs:
        raise InputError(f"{path}: no WFDB records (.hea files) in this folder, nor EDF/BDF files (.edf, .bdf)")
    return "wfdb" if heads else "edf"


def _open_wfdb(path: Path, lead: Lead) -> WfdbSource:
    import wfdb

    if path.is_dir():
        heads = sorted(path.glob("*.hea"))
        if not heads:
            raise InputError(f"{path}: no WFDB records (.hea files) in this folder")
    else:
        heads = [path.with_suffix(".hea")]
    recs, paths, channels = [], [], []
    for h in heads:
        stem = str(h.with_suffix(""))
        try:
            hdr = wfdb.rdheader(stem)
        except Exception as e:
            raise InputError(f"{h}: unreadable WFDB header ({type(e).__name__}: {e})".splitlines()[0]) from None
        if isinstance(lead, str):  # a label: the header's signal names
            channel = pick_channel(str(h), [str(n) for n in (hdr.sig_name or [])], lead)
        elif hdr.n_sig is None or lead >= hdr.n_sig or lead < 0:
            raise InputError(f"{h}: lead {lead} does not exist (record has {hdr.n_sig} signals)")
        else:
            channel = lead
        if not hdr.sig_len:
            raise InputError(f"{h}: record has no samples")
        reason = check_fs(hdr.fs)
        if reason:
            raise InputError(f"{h}: {reason}")
        _check_wfdb_files(h, hdr)
        recs.append(Recording(h.stem, float(hdr.fs), int(hdr.sig_len)))
        paths.append(stem)
        channels.append(channel)
    rates = {r.fs for r in recs}
    if len(rates) > 1:
        raise InputError(f"{path}: records have different sampling rates {sorted(rates)}")
    return WfdbSource(str(path), tuple(recs), lead=lead, record_paths=tuple(paths), channels=tuple(channels))


def _open_edf(path: Path, lead: Lead, option: str = "--lead") -> EdfSource:
    """An EDF/BDF file, or a folder of them (each a recording, by name), channel ``lead`` of each."""
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.is_file() and p.suffix.lower() in EDF_SUFFIXES),
                       key=lambda p: p.name)
    else:
        files = [path]
    chans = [open_channel(p, lead, option) for p in files]
    stems = [p.stem for p in files]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:  # a.edf and a.bdf would make two recordings of one name
        raise InputError(f"{path}: two files for recording {twice[0]!r} (.edf and .bdf); keep one")
    rates = {c.fs for c in chans}
    if len(rates) > 1:
        raise InputError(f"{path}: recordings have different sampling rates on {option} {describe(lead)}: "
                         f"{sorted(rates)}")
    recs = tuple(Recording(p.stem, c.fs, c.n_samples) for p, c in zip(files, chans))
    return EdfSource(str(path), recs, lead=lead, files=tuple(chans))


def _check_rate(fs) -> float:
    """``fs`` as a float, or an :class:`InputError` naming the option where it is no usable rate."""
    try:
        rate = float(fs)
    except (TypeError, ValueError):
        raise InputError(f"--fs {str(fs)[:40]!r}: sampling rate must be a number") from None
    reason = check_fs(rate)
    if reason:
        raise InputError(f"--fs {rate:g}: {reason}")
    return rate


def open_source(path, *, column: str | None = None, fs: float | None = None, lead: Lead = 0,
                option: str = "--lead") -> Source:
    """Open and check an input (cheap: headers, metadata and the first few KB only).

    Parameters
    ----------
    path : str or Path
        A CSV file (header line, float rows), a Parquet file, a ``.npy`` array, a WFDB record path
        (with or without ``.hea``), an EDF/EDF+/BDF file (``.edf``, ``.bdf``), or a folder of WFDB
        records or of EDF/BDF files.
    column : str, optional
        Column to read from a CSV or Parquet file with several.
    fs : float, optional
        Sampling rate of CSV/Parquet/npy input (default 250 Hz); WFDB and EDF headers carry their own
        (an EDF file's: that of the chosen channel).
    lead : int or str
        WFDB or EDF channel: its index, or its label (WFDB: the header's signal name).
    option : str
        The option that gave ``lead``, to name in messages (``--confirm-lead`` for the second lead).

    Returns
    -------
    Source

    Raises
    ------
    InputError
        A sampling rate out of range, a missing path, an empty, compressed, binary or truncated file,
        a file whose content is not what its suffix says, a header only, an unknown or non-numeric
        column, a folder without records, a WFDB signal file missing or shorter than its header says,
        an unknown channel (listing the labels), an EDF+D file...
    """
    p = Path(path)
    rate = _check_rate(fs) if fs is not None else DEFAULT_FS
    if p.is_dir():
        return _open_wfdb(p, lead) if _folder_kind(p) == "wfdb" else _open_edf(p, lead, option)
    if p.suffix == ".hea" or (not p.exists() and p.with_suffix(".hea").exists()):
        return _open_wfdb(p, lead)
    if not p.exists():
        raise InputError(f"{p}: no such file or folder")
    if p.stat().st_size == 0:
        raise InputError(f"{p}: empty file")
    head = _head(p)
    compressed = _sniff(p, head)
    if compressed:
        raise InputError(compressed)
    suffix = p.suffix.lower()
    if suffix in _COMPRESSED_SUFFIXES:  # named compressed, but is not: no reader guesses what it holds
        what = next(c[1] for c in _COMPRESSED if c[2] == suffix)
        raise InputError(f"{p}: named {suffix} but not {what} (starts with {head[:16]!r}); "
                         f"rename it to what it holds")
    is_parquet, is_npy = suffix in (".parquet", ".pq"), suffix == ".npy"
    if suffix in EDF_SUFFIXES:
        return _open_edf(p, lead, option)
    if looks_like_edf(head):
        rename = p.with_suffix(".bdf" if head.startswith(BDF_MAGIC) else ".edf").name
        raise InputError(f"{p}: an EDF/BDF file under another suffix; rename it to {rename}")
    if head.startswith(_PARQUET_MAGIC) and not is_parquet:
        raise InputError(f"{p}: a Parquet file (PAR1 magic) under another suffix; rename it to "
                         f"{p.with_suffix('.parquet').name}")
    if head.startswith(_NPY_MAGIC) and not is_npy:
        raise InputError(f"{p}: a NumPy .npy array under another suffix; rename it to {p.with_suffix('.npy').name}")
    if is_parquet:
        return _open_parquet(p, column, rate, head)
    if is_npy:
        return _open_npy(p, rate, head)
    return _open_csv(p, column, rate, head)


def open_second_lead(source: Source, path, fs: float | None = None, *, lead: Lead = 0, column: str | None = None,
                     confirm_lead: Lead | None = None, confirm_column: str | None = None) -> Source | None:
    """The second lead of ``source`` that checks its beats (:mod:`beatflow.detect.leads`): WFDB or EDF
    channel ``confirm_lead`` (an index or a label) or CSV/Parquet column ``confirm_column`` of the same
    input, with the same recordings, lengths and rates; None when neither is given.

    A channel of an EDF file sampled at another rate than the first lead is refused rather than
    resampled: the partitions are sample ranges of the first lead, and resampling each one alone
    (``scipy.signal.resample_poly``) would make the second lead's samples near a cut depend on where
    the cuts fall, so that the beats would depend on the partition count.

    Raises
    ------
    InputError
        Both or the wrong one given for the input's kind, the first lead again, a missing channel or
        column, or recordings of other lengths or rates.
    """
    if confirm_lead is None and not confirm_column:
        return None
    if confirm_lead is not None and confirm_column:
        raise InputError("give --confirm-lead (WFDB, EDF) or --confirm-column (CSV/Parquet), not both")
    if source.kind in ("wfdb", "edf"):
        name = source.kind.upper()
        if confirm_lead is None:
            raise InputError(f"{source.path}: {name} input takes --confirm-lead N or LABEL, not --confirm-column")
        if confirm_lead == lead:
            raise InputError(f"--confirm-lead {confirm_lead}: the second lead must differ from --lead {lead}")
        second = open_source(path, fs=fs, lead=confirm_lead, option="--confirm-lead")
        same = [r.name for r, a, b in zip(source.recordings, source.channels, second.channels) if a == b]
        if same:
            raise InputError(f"--confirm-lead {confirm_lead}: the second lead must differ from --lead {lead} "
                             f"(the same channel in {same[0]})")
        if source.kind == "edf":
            for first, other in zip(source.files, second.files):
                if first.fs != other.fs:
                    raise InputError(f"{first.path}: --confirm-lead {describe(confirm_lead)} ({other.label!r}) is "
                                     f"sampled at {other.fs:g} Hz, --lead {describe(lead)} ({first.label!r}) at "
                                     f"{first.fs:g} Hz; the second lead needs the first one's rate")
    elif source.kind in ("csv", "parquet"):
        if not confirm_column:
            raise InputError(f"{source.path}: {source.kind.upper()} input takes --confirm-column NAME, not --confirm-lead")
        if confirm_column == (column or getattr(source, "column", None)):
            raise InputError(f"--confirm-column {confirm_column}: the second lead must differ from the first")
        second = open_source(path, column=confirm_column, fs=fs)
    else:
        raise InputError(f"{source.path}: a .npy stream has one lead; a second lead needs WFDB, EDF or "
                         f"CSV/Parquet input")
    a = [(r.name, r.n_samples, r.fs) for r in source.recordings]
    b = [(r.name, r.n_samples, r.fs) for r in second.recordings]
    if a != b:
        raise InputError(f"{source.path}: the second lead's recordings differ from the first's (lengths or rates)")
    return second
