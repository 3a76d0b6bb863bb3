"""Prefect entry points of the flows (``prefect.yaml`` and the Prefect CLI find them here); the flows
themselves are in :mod:`beatflow.pipeline`."""
