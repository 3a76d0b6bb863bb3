"""Reading ECG streams: one-column CSV, Parquet, WFDB record folders, and ``.npy`` (synthetic).

A source is opened and checked once (cheaply: headers and metadata), then planned into partitions
that workers read independently, so no process holds the whole stream. Every problem is an
:class:`~beatflow.errors.InputError` whose message is one line naming the file.
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputError
from .params import DEFAULT_FS


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


def _check_finite(values: np.ndarray, where) -> None:
    if values.size and not np.isfinite(values).all():
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise InputError(where(bad, values[bad]))


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
        out = np.asarray(x[spec.start : spec.stop], dtype=np.float32)
        _check_finite(out, lambda i, v: f"{self.path}: sample {spec.start + i}: non-finite value {v}")
        return out


@dataclass(frozen=True)
class ParquetSource(Source):
    """One column of a Parquet file, read by row groups."""

    column: str = ""

    def read(self, spec: PartitionSpec) -> np.ndarray:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        pieces, row0 = [], 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            lo, hi = max(spec.start, row0), min(spec.stop, row0 + n)
            if lo < hi:
                col = pf.read_row_group(g, columns=[self.column]).column(0)
                pieces.append(col.slice(lo - row0, hi - lo).to_numpy(zero_copy_only=False))
            row0 += n
        try:
            out = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
        except (TypeError, ValueError) as e:
            raise InputError(f"{self.path}: column {self.column!r} is not numeric ({e})") from None
        _check_finite(out, lambda i, v: f"{self.path}: row {spec.start + i + 1}: non-finite value {v}")
        return out


@dataclass(frozen=True)
class WfdbSource(Source):
    """A folder of WFDB records (``.hea`` + signal files), one channel (``lead``) of each."""

    lead: int = 0
    record_paths: tuple[str, ...] = field(default=())

    def read(self, spec: PartitionSpec) -> np.ndarray:
        import wfdb

        rec_path = self.record_paths[spec.recording]
        try:
            rec = wfdb.rdrecord(rec_path, sampfrom=spec.start, sampto=spec.stop, channels=[self.lead])
        except Exception as e:  # wfdb raises many kinds
            raise InputError(f"{rec_path}: cannot read WFDB record ({type(e).__name__}: {e})".splitlines()[0]) from None
        out = np.asarray(rec.p_signal[:, 0], dtype=np.float32)
        _check_finite(out, lambda i, v: f"{rec_path}: sample {spec.start + i}: non-finite value {v}")
        return out


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

    def _line_of(self, spec: PartitionSpec, chunk: bytes, bad) -> tuple[int, bytes]:
        """1-based file line number and text of the first line of ``chunk`` for which ``bad`` holds."""
        before = 1  # the header
        with open(self.path, "rb") as f:
            f.seek(self.data_start)
            remaining = spec.start - self.data_start
            while remaining > 0:
                block = f.read(min(remaining, 1 << 24))
                before += block.count(b"\n")
                remaining -= len(block)
        ci = self.names.index(self.column)
        for k, line in enumerate(chunk.split(b"\n")):
            line = line.rstrip(b"\r")
            if not line.strip():
                continue
            fields = line.split(b",")
            value = fields[ci].strip() if ci < len(fields) else b""
            if bad(value):
                return before + k + 1, value
        return before + 1, b""

    def read(self, spec: PartitionSpec) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        with open(self.path, "rb") as f:
            f.seek(spec.start)
            chunk = f.read(spec.stop - spec.start)
        if not chunk.strip():
            return np.zeros(0, np.float32)
        try:
            table = pcsv.read_csv(
                io.BytesIO(chunk),
                read_options=pcsv.ReadOptions(column_names=list(self.names)),
                convert_options=pcsv.ConvertOptions(column_types={self.column: pa.float32()},
                                                    include_columns=[self.column]),
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError):

            def unparsable(v: bytes) -> bool:
                try:
                    float(v)
                    return False
                except ValueError:
                    return True

            line, value = self._line_of(spec, chunk, unparsable)
            raise InputError(f"{self.path}: line {line}: cannot parse {value.decode(errors='replace')!r} "
                             f"as a number in column {self.column!r}") from None
        out = table.column(0).to_numpy(zero_copy_only=False)
        if out.dtype != np.float32 or np.isnan(out).any():
            # nulls (empty fields) arrive as NaN; 'nan'/'inf' text too
            pass
        if not np.isfinite(out).all():
            def nonfinite(v: bytes) -> bool:
                try:
                    return not math.isfinite(float(v))
                except ValueError:
                    return True

            line, value = self._line_of(spec, chunk, nonfinite)
            raise InputError(f"{self.path}: line {line}: non-finite or missing value "
                             f"{value.decode(errors='replace')!r} in column {self.column!r}")
        return out.astype(np.float32, copy=False)


def _open_csv(path: Path, column: str | None, fs: float) -> CsvSource:
    with open(path, "rb") as f:
        header = f.readline()
        data_start = f.tell()
        first = f.readline()
        while first and not first.strip():
            first = f.readline()
    names = [h.strip().strip('"') for h in header.decode("utf-8", errors="replace").strip().split(",")]
    if not header.strip():
        raise InputError(f"{path}: empty file")
    if not first:
        raise InputError(f"{path}: header only, no samples")
    if column is None:
        if len(names) != 1:
            raise InputError(f"{path}: {len(names)} columns ({', '.join(names)}): choose one with --column")
        column = names[0]
    elif column not in names:
        raise InputError(f"{path}: unknown column {column!r} (columns: {', '.join(names)})")
    try:
        float(names[names.index(column)])
        raise InputError(f"{path}: the first line must be a header naming the columns, got {header.strip()[:40]!r}")
    except ValueError:
        pass
    return CsvSource(str(path), (Recording(path.stem, fs, None),), column=column, names=tuple(names),
                     data_start=data_start)


def _open_parquet(path: Path, column: str | None, fs: float) -> ParquetSource:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})".splitlines()[0]) from None
    names = pf.schema_arrow.names
    if column is None:
        if len(names) != 1:
            raise InputError(f"{path}: {len(names)} columns ({', '.join(names)}): choose one with --column")
        column = names[0]
    elif column not in names:
        raise InputError(f"{path}: unknown column {column!r} (columns: {', '.join(names)})")
    n = pf.metadata.num_rows
    if n == 0:
        raise InputError(f"{path}: no samples")
    return ParquetSource(str(path), (Recording(path.stem, fs, n),), column=column)


def _open_wfdb(path: Path, lead: int) -> WfdbSource:
    import wfdb

    if path.is_dir():
        heads = sorted(path.glob("*.hea"))
        if not heads:
            raise InputError(f"{path}: no WFDB records (.hea files) in this folder")
    else:
        heads = [path.with_suffix(".hea")]
    recs, paths = [], []
    for h in heads:
        stem = str(h.with_suffix(""))
        try:
            hdr = wfdb.rdheader(stem)
        except Exception as e:
            raise InputError(f"{h}: unreadable WFDB header ({type(e).__name__}: {e})".splitlines()[0]) from None
        if hdr.n_sig is None or lead >= hdr.n_sig or lead < 0:
            raise InputError(f"{h}: lead {lead} does not exist (record has {hdr.n_sig} signals)")
        if not hdr.sig_len:
            raise InputError(f"{h}: record has no samples")
        recs.append(Recording(h.stem, float(hdr.fs), int(hdr.sig_len)))
        paths.append(stem)
    rates = {r.fs for r in recs}
    if len(rates) > 1:
        raise InputError(f"{path}: records have different sampling rates {sorted(rates)}")
    return WfdbSource(str(path), tuple(recs), lead=lead, record_paths=tuple(paths))


def open_source(path, *, column: str | None = None, fs: float | None = None, lead: int = 0) -> Source:
    """Open and check an input (cheap: headers and metadata only).

    Parameters
    ----------
    path : str or Path
        A CSV file (header line, float rows), a Parquet file, a ``.npy`` array, a folder of WFDB
        records, or a WFDB record path (with or without ``.hea``).
    column : str, optional
        Column to read from a CSV or Parquet file with several.
    fs : float, optional
        Sampling rate of CSV/Parquet/npy input (default 250 Hz); WFDB headers carry their own.
    lead : int
        WFDB channel.

    Returns
    -------
    Source

    Raises
    ------
    InputError
        Missing path, empty file, header only, unknown column, folder without records...
    """
    p = Path(path)
    rate = float(fs) if fs is not None else DEFAULT_FS
    if not rate > 0:
        raise InputError(f"{p}: sampling rate must be positive, got {fs}")
    if p.is_dir() or p.suffix == ".hea" or (not p.exists() and p.with_suffix(".hea").exists()):
        return _open_wfdb(p, lead)
    if not p.exists():
        raise InputError(f"{p}: no such file or folder")
    if p.stat().st_size == 0:
        raise InputError(f"{p}: empty file")
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return _open_parquet(p, column, rate)
    if suffix == ".npy":
        try:
            arr = np.load(p, mmap_mode="r")
        except Exception as e:
            raise InputError(f"{p}: not a readable .npy array ({e})".splitlines()[0]) from None
        if arr.ndim != 1 or arr.shape[0] == 0:
            raise InputError(f"{p}: expected a non-empty 1-D array, got shape {arr.shape}")
        return NpySource(str(p), (Recording(p.stem, rate, int(arr.shape[0])),))
    return _open_csv(p, column, rate)


def open_second_lead(source: Source, path, fs: float | None = None, *, lead: int = 0, column: str | None = None,
                     confirm_lead: int | None = None, confirm_column: str | None = None) -> Source | None:
    """The second lead of ``source`` that checks its beats (:mod:`beatflow.leads`): WFDB channel
    ``confirm_lead`` or CSV/Parquet column ``confirm_column`` of the same input, with the same
    recordings and lengths; None when neither is given.

    Raises
    ------
    InputError
        Both or the wrong one given for the input's kind, the first lead again, a missing channel or
        column, or recordings of other lengths or rates.
    """
    if confirm_lead is None and not confirm_column:
        return None
    if confirm_lead is not None and confirm_column:
        raise InputError("give --confirm-lead (WFDB) or --confirm-column (CSV/Parquet), not both")
    if source.kind == "wfdb":
        if confirm_lead is None:
            raise InputError(f"{source.path}: WFDB input takes --confirm-lead N, not --confirm-column")
        if confirm_lead == lead:
            raise InputError(f"--confirm-lead {confirm_lead}: the second lead must differ from --lead {lead}")
        second = open_source(path, fs=fs, lead=confirm_lead)
    elif source.kind in ("csv", "parquet"):
        if not confirm_column:
            raise InputError(f"{source.path}: {source.kind.upper()} input takes --confirm-column NAME, not --confirm-lead")
        if confirm_column == (column or getattr(source, "column", None)):
            raise InputError(f"--confirm-column {confirm_column}: the second lead must differ from the first")
        second = open_source(path, column=confirm_column, fs=fs)
    else:
        raise InputError(f"{source.path}: a .npy stream has one lead; a second lead needs WFDB or CSV/Parquet input")
    a = [(r.name, r.n_samples, r.fs) for r in source.recordings]
    b = [(r.name, r.n_samples, r.fs) for r in second.recordings]
    if a != b:
        raise InputError(f"{source.path}: the second lead's recordings differ from the first's (lengths or rates)")
    return second
