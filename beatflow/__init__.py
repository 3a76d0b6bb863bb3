"""beatflow: long ECG recordings to a list of abnormal heartbeats.

From Python: ``beatflow.run(input=..., out=..., **options)`` runs the flow of ``beatflow run`` and returns
its outputs; ``beatflow.read(path, ...)`` reads an input as the flow does (:mod:`beatflow.api`).
"""

from beatflow.version import __version__  # noqa: F401

__all__ = ["Result", "Signal", "read", "run"]


def __getattr__(name):
    # beatflow.api on first use, so that ``import beatflow`` (and every command) stays light
    if name in __all__:
        from beatflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'beatflow' has no attribute {name!r}")
