"""CPU: a compiled VAE training of the 20 h default's size, timed in a fresh process (session 16).

97 102 random rows × 256 (the default run's beat matrix), ``train_vae(..., compile=True)``, 2 threads.
Run it twice with the same empty ``TORCHINDUCTOR_CACHE_DIR`` to time the compilation cold, then warm::

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind EP=3 .venv/bin/python bench/train_compile_cold.py   # cold
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind EP=3 .venv/bin/python bench/train_compile_cold.py   # warm
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from beatflow.model.vae import train_vae  # noqa: E402


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    x = (np.random.default_rng(0).normal(size=(97102, 256)) * 0.05).astype(np.float32)
    t = time.perf_counter()
    r = train_vae(x, epochs=int(os.environ.get("EP", "3")), compile=True, seed=0)
    print(f"total {time.perf_counter() - t:.1f} s, compiled={r.compiled}, test loss {r.test_loss:.6f}, "
          f"train losses {[round(v, 6) for v in r.train_loss]}")


if __name__ == "__main__":
    main()
