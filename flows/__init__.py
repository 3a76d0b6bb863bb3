"""Prefect flows of beatflow."""
