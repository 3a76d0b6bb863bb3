"""The Prefect tasks of the flows, by stage (entry points: they live in :mod:`beatflow.pipeline`)."""
from beatflow.pipeline.inbox import score_inbox_item
from beatflow.pipeline.stages import build_engine, embed, load, score, segment, synthesize, train_model, write_report

__all__ = ["build_engine", "embed", "load", "score", "score_inbox_item", "segment", "synthesize", "train_model",
           "write_report"]
