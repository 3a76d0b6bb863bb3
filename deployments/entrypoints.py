"""Deployment entry points of ``prefect.yaml`` (the flows live in :mod:`beatflow.pipeline.deployments`)."""
from beatflow.pipeline.deployments import benchmark, train_and_score

__all__ = ["benchmark", "train_and_score"]
