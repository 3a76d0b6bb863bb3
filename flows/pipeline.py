"""The Prefect flow of ``beatflow run`` (an entry point: the flow lives in :mod:`beatflow.pipeline.flow`)."""
from beatflow.pipeline.flow import ecg_anomaly_flow

__all__ = ["ecg_anomaly_flow"]
