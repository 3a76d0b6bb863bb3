"""The LightVAE, its training and its GPU step kernel (see docs/design.md)."""

from beatflow.engine.options import compiler_caches

compiler_caches()  # before anything in this package compiles (torch.compile of the training steps)
