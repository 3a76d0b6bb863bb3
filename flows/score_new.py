"""The Prefect flow of ``beatflow score`` and of the ``score-new-recordings`` deployment (an entry point:
the flow lives in :mod:`beatflow.pipeline.inbox_flow`)."""
from beatflow.pipeline.inbox_flow import score_new_recordings

__all__ = ["score_new_recordings"]
