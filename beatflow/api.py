"""beatflow from Python (a notebook, a script): :func:`run` runs the flow that ``beatflow run`` runs, with
the same options, and returns its outputs as Python objects; :func:`read` reads an input as the flow does.

Both import Prefect, Dask and PyTorch only when called (``import beatflow`` stays light).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from beatflow.errors import InputError

__all__ = ["Result", "Signal", "read", "run"]


@dataclass(frozen=True)
class Signal:
    """One recording as the flow reads it: its samples (float, the reader's physical units) and rate."""

    name: str
    fs: float
    values: np.ndarray = field(repr=False)

    @property
    def duration_s(self) -> float:
        return len(self.values) / self.fs


class Result:
    """The outputs of one run, read when first asked for.

    Attributes
    ----------
    out : Path
        The run's output folder.
    summary : dict
        ``summary.json``.
    beats : pandas.DataFrame
        ``anomalies.parquet``: one row per kept beat (time, class, RR intervals, prematurity, score,
        flag, rank).
    quality : pandas.DataFrame
        ``quality.csv``: the unreadable stretches.
    report : Path
        ``report.html``, the self-contained report page.
    """

    def __init__(self, out):
        self.out = Path(out)

    def __repr__(self) -> str:
        s = self.summary
        return (f"Result(out={str(self.out)!r}, beats_kept={s.get('beats_kept')}, "
                f"anomalies_flagged={s.get('anomalies_flagged')})")

    @cached_property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    @cached_property
    def beats(self):
        import pandas as pd

        return pd.read_parquet(self.out / "anomalies.parquet")

    @cached_property
    def quality(self):
        import pandas as pd

        return pd.read_csv(self.out / "quality.csv")

    @property
    def report(self) -> Path:
        return self.out / "report.html"


def read(path, *, column: str | None = None, fs: float | None = None, lead: int = 0):
    """Read an ECG input whole, as the flow's readers read it (checked the same way).

    Parameters
    ----------
    path : str or Path
        A CSV, Parquet or ``.npy`` file, a WFDB record, or a folder of WFDB records.
    column : str, optional
        The column of a CSV or Parquet file with several.
    fs : float, optional
        The sampling rate of CSV, Parquet or ``.npy`` input (default 250 Hz); WFDB headers carry theirs.
    lead : int
        The WFDB channel.

    Returns
    -------
    Signal
        For a file or record; a list of :class:`Signal`, one per record, for a folder.

    Raises
    ------
    InputError
        What ``beatflow run --input`` refuses, with the same one-line message.

    Examples
    --------
    >>> import numpy as np, beatflow, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ecg.npy")
    >>> np.save(path, np.sin(np.linspace(0, 60, 2500)).astype("float32"))
    >>> sig = beatflow.read(path, fs=250)
    >>> sig.fs, len(sig.values), sig.duration_s
    (250.0, 2500, 10.0)
    """
    from beatflow.io.sources import open_source

    src = open_source(path, column=column, fs=fs, lead=lead)
    parts: dict[int, list] = {}
    for spec in src.plan(len(src.recordings)):
        parts.setdefault(spec.recording, []).append(np.asarray(src.read(spec)))
    signals = [Signal(rec.name, float(rec.fs), np.concatenate(parts[i]) if len(parts[i]) > 1 else parts[i][0])
               for i, rec in enumerate(src.recordings)]
    return signals if Path(path).is_dir() else signals[0]


def _run_options() -> argparse.ArgumentParser:
    from beatflow.cli import _run_parser

    sub = argparse.ArgumentParser(prog="beatflow").add_subparsers(dest="command")
    _run_parser(sub)
    return sub.choices["run"]


def _argv(parser: argparse.ArgumentParser, options: dict) -> list[str]:
    """``beatflow run``'s command line for keyword options (``confirm_lead=1`` is ``--confirm-lead 1``;
    ``verbose=True`` is ``-v``; ``None`` and ``False`` leave an option out)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    unknown = sorted(set(options) - set(actions))
    if unknown:
        raise TypeError(f"beatflow.run() got unknown option(s) {', '.join(unknown)}; "
                        f"it takes: {', '.join(sorted(actions))}")
    argv = ["run"]
    for name, value in options.items():
        act, flag = actions[name], actions[name].option_strings[-1]
        if act.nargs == 0:  # a switch
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def run(input=None, out=None, **options) -> Result:
    """Run the flow as ``beatflow run`` does, with the same options, and return its outputs.

    Parameters
    ----------
    input : str or Path, optional
        An ECG input (what :func:`read` reads); none: the synthetic 20 h ECG (``hours=`` sets its length).
    out : str or Path, optional
        The output folder (default ``runs/<timestamp>``); it must not exist or must be empty.
    **options
        ``beatflow run``'s options by their Python names: ``fs=360``, ``lead=0``, ``confirm_lead=1``,
        ``hours=2``, ``device="gpu"``, ``workers=4``, ``epochs=10``, ``train_beats=20000``,
        ``no_service=True``, ``verbose=True``... (``beatflow run --help`` lists them all).

    Returns
    -------
    Result
        ``result.beats`` (the anomalies table, a DataFrame), ``result.summary`` (a dict), ``result.report``
        (the report's path), ``result.quality`` and ``result.out``.

    Raises
    ------
    InputError
        Bad input or options, with the one line the command prints; nothing is left at ``out``.
    TypeError
        An option ``beatflow run`` does not have.

    Examples
    --------
    >>> import beatflow, tempfile
    >>> result = beatflow.run(hours=0.1, out=tempfile.mkdtemp(), epochs=1)  # doctest: +SKIP
    >>> result.beats[["time_s", "class", "score", "flagged"]].head()         # doctest: +SKIP
    >>> result.summary["classes"]["counts"]                                    # doctest: +SKIP
    """
    from beatflow import cli
    from beatflow.terminal import run_cleanups

    parser = _run_options()
    if input is not None:
        options["input"] = str(input)
    if out is not None:
        options["out"] = str(out)
    argv = _argv(parser, options)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv[1:])
    except SystemExit:  # argparse's message, as one line
        raise InputError(err.getvalue().strip().splitlines()[-1].replace("beatflow: error: ", "")) from None
    args.command, args.quiet = "run", True
    try:
        cli.cmd_run(args)
    except KeyboardInterrupt:  # as the command does on Ctrl-C: nothing left at --out
        run_cleanups()
        raise
    return Result(args.summary["out"])
