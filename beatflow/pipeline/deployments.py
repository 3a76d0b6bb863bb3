"""Deployment entry points: flows that choose their task runner from their parameters.

A deployment runs the flow function directly, so the Dask task runner (CPU LocalCluster or
GPU LocalCUDACluster) is chosen here, from the parameters a user sets in the Prefect UI.
"""
from __future__ import annotations

from prefect import flow

from beatflow.device import resolve_device
from beatflow.pipeline.flow import ecg_anomaly_flow
from beatflow.pipeline.cluster import make_task_runner


@flow(name="train-and-score", log_prints=True)
def train_and_score(input: str | None = None, device: str = "auto", workers: int = 2, hours: float = 20.0,
                    seed: int = 0, out: str | None = None, epochs: int = 10, store: str | None = ".beatflow",
                    lead: int = 0, column: str | None = None, confirm_lead: int | None = None,
                    confirm_column: str | None = None) -> dict:
    """Run the full pipeline (segment, embed, train, build the engine, score, report); ``lead`` /
    ``column`` choose the input's lead, ``confirm_lead`` / ``confirm_column`` a second one that checks
    the beats (``beatflow run --confirm-lead``)."""
    dev = resolve_device(device)
    runner = make_task_runner(dev, workers)
    return ecg_anomaly_flow.with_options(task_runner=runner)(
        input=input, hours=hours, seed=seed, out=out, device=dev, workers=workers, epochs=epochs, store=store,
        lead=lead, column=column, confirm_lead=confirm_lead, confirm_column=confirm_column)


@flow(name="benchmark", log_prints=True)
def benchmark(hours: float = 20.0) -> str:
    """Run bench/pipeline_bench.py and keep its table as a markdown artifact."""
    import subprocess
    import sys
    from pathlib import Path

    from prefect.artifacts import create_markdown_artifact

    root = Path(__file__).resolve().parents[2]  # (the checkout: bench/ is not installed)
    r = subprocess.run([sys.executable, str(root / "bench" / "pipeline_bench.py"), "--hours", str(hours)],
                       capture_output=True, text=True, cwd=root, check=True)
    create_markdown_artifact(r.stdout, key="beatflow-benchmark", description="pipeline benchmark")
    return r.stdout
