"""EDF, EDF+ and BDF files (what Holter and polysomnography recorders export): one channel of each.

The samples are read with pyedflib (EDFlib), by sample range, in physical units converted to
millivolts where the channel's physical dimension is a volt unit (``uV``, ``mV``, ``V``...), as the
WFDB records and the synthetic ECG hold; a channel of another or no dimension is read as the header's
physical values.

The fixed-layout header is also parsed here by hand, before pyedflib opens the file: EDFlib answers a
truncated file, a discontinuous one or a channel with no samples with an error code (and a line on
standard output), and the header's fields give what the one-line message needs (the sizes, the
channel, its rate). Annotation channels (``EDF Annotations``) are never an ECG lead: EDFlib leaves
them out of EDF+/BDF+ signals, and a plain EDF channel of that label is refused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from beatflow.errors import InputError
from beatflow.io.channels import Lead, describe, listing, pick_channel
from beatflow.params import check_fs

EDF_SUFFIXES = (".edf", ".bdf")
EDF_MAGIC = b"0       "  # the version field of an EDF/EDF+ file
BDF_MAGIC = b"\xffBIOSEMI"  # of a BDF/BDF+ file (24-bit samples)
ANNOTATION_LABELS = ("edf annotations", "bdf annotations")
# millivolts per unit of the physical dimensions converted (case-insensitive)
TO_MV = {"nv": 1e-6, "uv": 1e-3, "µv": 1e-3, "μv": 1e-3, "mv": 1.0, "v": 1e3, "kv": 1e6}
_FIXED = 256  # bytes of the fixed header, and of each signal's header
# a signal's header fields (bytes each), stored field by field over all signals
_SIGNAL_FIELDS = (("label", 16), ("transducer", 80), ("dimension", 8), ("physical_min", 8), ("physical_max", 8),
                  ("digital_min", 8), ("digital_max", 8), ("prefilter", 80), ("samples_per_record", 8),
                  ("reserved", 32))


def looks_like_edf(head: bytes) -> bool:
    """Whether a file's first bytes are an EDF or BDF header (the version field and a sane header size)."""
    if len(head) < _FIXED or not head.startswith((EDF_MAGIC, BDF_MAGIC)):
        return False
    try:
        n_bytes, ns = int(head[184:192]), int(head[252:256])
    except ValueError:
        return False
    return ns > 0 and n_bytes == _FIXED * (ns + 1)


@dataclass(frozen=True)
class EdfHeader:
    """The header of an EDF/BDF file, every signal included (annotation channels too)."""

    kind: str  # "EDF", "EDF+", "BDF" or "BDF+"
    header_bytes: int
    n_records: int
    record_s: float
    labels: tuple[str, ...]
    dimensions: tuple[str, ...]
    samples_per_record: tuple[int, ...]

    @property
    def plus(self) -> bool:
        return self.kind.endswith("+")

    @property
    def bytes_per_sample(self) -> int:
        return 3 if self.kind.startswith("BDF") else 2

    def signals(self) -> list[int]:
        """The signals pyedflib reads, as indices of the header's: an EDF+/BDF+ file's annotation
        channels are none of them (EDFlib's own rule)."""
        own = "BDF Annotations" if self.kind.startswith("BDF") else "EDF Annotations"
        return [i for i, label in enumerate(self.labels) if not (self.plus and label == own)]


def _field(path: Path, raw: bytes, name: str, kind=int):
    text = raw.decode("ascii", errors="replace").strip()
    try:
        return kind(text)
    except ValueError:
        raise InputError(f"{path}: not a valid EDF header ({name} {text[:20]!r} is not a number)") from None


def read_header(path: Path) -> EdfHeader:
    """Parse and check the header of ``path`` against the file's size.

    Raises
    ------
    InputError
        Not an EDF/BDF file, a header cut short or with fields that are no numbers, a discontinuous
        EDF+D/BDF+D file, no data records, a file shorter than its header says.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        fixed = f.read(_FIXED)
        if not fixed.startswith((EDF_MAGIC, BDF_MAGIC)):
            raise InputError(f"{path}: not an EDF or BDF file (the version field is {fixed[:8]!r}, "
                             f"not {EDF_MAGIC!r} or {BDF_MAGIC!r})")
        if len(fixed) < _FIXED:
            raise InputError(f"{path}: {size} bytes, shorter than an EDF header ({_FIXED} bytes): truncated?")
        ns = _field(path, fixed[252:256], "number of signals")
        header_bytes = _field(path, fixed[184:192], "header size")
        if ns <= 0 or header_bytes != _FIXED * (ns + 1):
            raise InputError(f"{path}: not a valid EDF header ({ns} signals in {header_bytes} header bytes, "
                             f"where {ns} signals take {_FIXED * (ns + 1)})")
        raw = f.read(_FIXED * ns)
    if len(raw) < _FIXED * ns:
        raise InputError(f"{path}: {size} bytes, the header of {ns} signals takes {header_bytes}: truncated?")
    fields, at = {}, 0
    for name, width in _SIGNAL_FIELDS:
        fields[name] = [raw[at + k * width : at + (k + 1) * width] for k in range(ns)]
        at += width * ns
    bdf = fixed.startswith(BDF_MAGIC)
    reserved = fixed[192:236].decode("ascii", errors="replace").strip()
    plus = reserved[:4] in ("EDF+", "BDF+")
    if plus and reserved[4:5] == "D":
        raise InputError(f"{path}: a discontinuous {reserved[:3]}+ file ({reserved[:5]}: its data records have "
                         f"gaps in time); beatflow reads continuous recordings (EDF+C, BDF+C or plain EDF/BDF)")
    n_records = _field(path, fixed[236:244], "number of data records")
    record_s = _field(path, fixed[244:252], "data record duration", float)
    if n_records == -1:
        raise InputError(f"{path}: the header gives -1 data records (the recorder did not finish the file)")
    if n_records <= 0:
        raise InputError(f"{path}: no samples ({n_records} data records)")
    hdr = EdfHeader(kind=("BDF" if bdf else "EDF") + "+" * plus, header_bytes=header_bytes, n_records=n_records,
                    record_s=record_s,
                    labels=tuple(b.decode("latin-1").strip() for b in fields["label"]),
                    dimensions=tuple(b.decode("latin-1").strip() for b in fields["dimension"]),
                    samples_per_record=tuple(_field(path, b, "samples per data record")
                                             for b in fields["samples_per_record"]))
    if not record_s > 0:
        raise InputError(f"{path}: data record duration {record_s:g} s; the sampling rates "
                         f"(samples per data record / duration) are not positive")
    for label, spr in zip(hdr.labels, hdr.samples_per_record):
        if spr <= 0:
            raise InputError(f"{path}: channel {label!r} has {spr} samples per data record; "
                             f"its sampling rate is not positive")
    record_bytes = sum(hdr.samples_per_record) * hdr.bytes_per_sample
    need = header_bytes + n_records * record_bytes
    if size < need:
        raise InputError(f"{path}: {size} bytes, the header needs {n_records} data records of {record_bytes} bytes "
                         f"+ {header_bytes} header bytes ({need} bytes): truncated?")
    return hdr


@dataclass(frozen=True)
class EdfChannel:
    """One channel of an EDF/BDF file, as :class:`beatflow.io.sources.EdfSource` reads it."""

    path: str
    channel: int  # pyedflib's index (annotation channels of EDF+/BDF+ left out)
    label: str
    fs: float
    n_samples: int
    dimension: str
    scale: float  # to millivolts (1.0 where the dimension is no volt unit)


def open_channel(path, lead: Lead, option: str = "--lead") -> EdfChannel:
    """Open ``path`` (cheap: its header) and check channel ``lead`` (an index or a label).

    Raises
    ------
    InputError
        As :func:`read_header`; an unknown channel (listing the labels), an annotation channel, a
        sampling rate out of range or not positive, a file pyedflib cannot open.
    """
    import pyedflib

    path = Path(path)
    hdr = read_header(path)
    signals = hdr.signals()
    labels = [hdr.labels[i] for i in signals]
    annotations = [k for k, label in enumerate(labels) if label.strip().lower() in ANNOTATION_LABELS]
    if isinstance(lead, int) and lead in annotations:
        raise InputError(f"{path}: {option} {lead}: {labels[lead]!r} is an annotation channel, not an ECG lead "
                         f"(channels: {listing(labels, annotations)})")
    k = pick_channel(str(path), labels, lead, option, skip=annotations)
    i = signals[k]
    spr = hdr.samples_per_record[i]
    fs = spr / hdr.record_s
    reason = check_fs(fs)
    if reason:
        raise InputError(f"{path}: channel {k} {labels[k]!r}: {spr} samples per {hdr.record_s:g} s data record; "
                         f"{reason}")
    try:
        reader = pyedflib.EdfReader(str(path), annotations_mode=pyedflib.DO_NOT_READ_ANNOTATIONS)
    except OSError as e:  # EDFlib's message, prefixed with the file's name
        msg = str(e).removeprefix(f"{path}: ")
        raise InputError(f"{path}: not a readable {hdr.kind} file ({msg})".splitlines()[0]) from None
    try:
        n = int(reader.getNSamples()[k])
        fs_lib = float(reader.getSampleFrequency(k))
        label = reader.getLabel(k).strip()
    finally:
        reader.close()
    if n == 0:
        raise InputError(f"{path}: channel {k} {label!r} has no samples")
    dim = hdr.dimensions[i]
    scale = TO_MV.get(dim.strip().casefold(), 1.0)
    return EdfChannel(str(path), k, label, fs_lib if fs_lib > 0 else fs, n, dim, scale)


def read_channel(ch: EdfChannel, start: int, stop: int) -> np.ndarray:
    """Samples ``[start, stop)`` of the channel, in millivolts where its dimension is a volt unit
    (float64: the caller checks and casts)."""
    import pyedflib

    stop = min(stop, ch.n_samples)  # (pyedflib prints a line when asked for more than there is)
    if stop <= start:
        return np.zeros(0)
    try:
        with pyedflib.EdfReader(ch.path, annotations_mode=pyedflib.DO_NOT_READ_ANNOTATIONS) as reader:
            x = reader.readSignal(ch.channel, start=start, n=stop - start)
    except OSError as e:
        raise InputError(f"{ch.path}: cannot read channel {describe(ch.label)} ({e})".splitlines()[0]) from None
    return x * ch.scale if ch.scale != 1.0 else x
