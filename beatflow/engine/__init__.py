"""Inference engines: options (no PyTorch), the backends, validation and the cache (see docs/design.md)."""

from beatflow.engine.options import compiler_caches

compiler_caches()  # before any backend compiles (Inductor, AOTInductor, Triton)
