"""The stages' partition functions (tasks.stages): what runs on the workers, without a cluster."""
from __future__ import annotations

import numpy as np
import pytest

from beatflow.errors import InputError
from tasks import stages as T


class _FlakySource:
    """A source whose first ``failures`` reads raise ``error``."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    def read(self, spec):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return np.arange(spec, dtype=np.float32)


def test_load_partition_tries_a_failed_read_again():
    src = _FlakySource(T.LOAD_ATTEMPTS - 1, OSError("share went away"))
    x = T.load_partition(5, src, "cpu")
    assert src.calls == T.LOAD_ATTEMPTS and np.array_equal(x, np.arange(5, dtype=np.float32))


def test_load_partition_gives_up_after_its_attempts():
    src = _FlakySource(T.LOAD_ATTEMPTS, OSError("share went away"))
    with pytest.raises(OSError, match="share went away"):
        T.load_partition(5, src, "cpu")
    assert src.calls == T.LOAD_ATTEMPTS


def test_load_partition_does_not_retry_bad_input():
    src = _FlakySource(1, InputError("in.csv line 7: not a number"))
    with pytest.raises(InputError, match="line 7"):
        T.load_partition(5, src, "cpu")
    assert src.calls == 1

