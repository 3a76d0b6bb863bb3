"""Prefect tasks (thin wrappers over ``beatflow``) and the Dask plumbing they run on."""
