"""The options of one run of the pipeline's flow, as one typed object."""
from __future__ import annotations

from dataclasses import dataclass

from beatflow.params import TRAIN_BEATS


@dataclass(frozen=True)
class RunOptions:
    """The options of one run: the parameters of :func:`beatflow.pipeline.flow.ecg_anomaly_flow` (documented
    there), built once by the flow and read by its stages."""

    input: str | None = None
    column: str | None = None
    fs: float | None = None
    lead: int | str = 0  # an index or a label (WFDB, EDF)
    confirm_lead: int | str | None = None
    confirm_column: str | None = None
    hours: float = 20.0
    seed: int = 0
    out: str | None = None
    device: str = "cpu"
    workers: int | None = 2
    partitions: int | None = None
    epochs: int = 10
    batch_size: int = 1024
    train_beats: int | None = TRAIN_BEATS
    store: str | None = None
    cache: str | None = None
    engine_backend: str = "auto"
    precision: str = "fp32"
    train_precision: str = "auto"
    train_compile: bool | None = None
    rmm_pool_size: str | float | None = None
    rmm_allocator: str = "async"
    service: bool = False

    @property
    def confirm(self) -> tuple:
        """The second lead asked for: ``(confirm_lead, confirm_column)``."""
        return self.confirm_lead, self.confirm_column
