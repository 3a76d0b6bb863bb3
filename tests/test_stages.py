"""The stages' partition functions (beatflow.pipeline.stages): what runs on the workers, without a cluster."""
from __future__ import annotations

import numpy as np
import pytest

from beatflow.errors import DeviceError, InputError
from beatflow.pipeline import stages as T
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


def test_load_partition_keeps_its_phases_for_the_edges_under_its_stash_name():
    src = _FlakySource(1, OSError("share went away"))
    x = T.load_partition(5000, src, "cpu", stash="run-0")
    n, head, tail, phases = T.partition_edges(x, "run-0", halo=100)
    assert (n, len(head), len(tail)) == (5000, 100, 100)
    assert set(phases) == {"setup", "read", "to_device", "attempts", "span"} and phases["attempts"] == 2
    assert all(phases[k] >= 0 for k in ("setup", "read", "to_device"))
    took = phases["span"][1] - phases["span"][0]  # the call's wall-clock span holds its parts
    assert sum(phases[k] for k in ("setup", "read", "to_device")) <= took + 1e-3 and took < 5
    assert T.partition_edges(x, "run-0", halo=100)[3] == {}  # taken once: nothing left behind on the worker
    assert T.partition_edges(x, halo=100)[3] == {}
    T.load_partition(50, _FlakySource(0, None), "cpu")  # no stash name: nothing kept
    assert T._LOAD_PHASES == {}


def test_load_phases_sums_and_maxima_over_partitions():
    got = T.load_phases(0.5, 0.01, [{"setup": 0.001, "read": 0.2, "to_device": 0.05, "attempts": 1},
                                   {"setup": 0.002, "read": 0.1, "to_device": 0.07, "attempts": 3}, {}])
    assert got == {"partitions": 0.5, "edges": 0.01, "setup_max": 0.002, "setup_sum": 0.003, "read_max": 0.2,
                   "read_sum": 0.3, "to_device_max": 0.07, "to_device_sum": 0.12, "reads_retried": 2}
    assert T.load_phases(0.5, 0.01, [{}]) == {"partitions": 0.5, "edges": 0.01}
    # with the dispatch's and the wait's wall clocks, the partitions' time split around their spans
    spans = [{"read": 0.2, "span": (100.25, 100.4)}, {"read": 0.1, "span": (100.1, 100.3)}, {}]
    got = T.load_phases(0.5, 0.01, spans, (100.0, 100.5))
    assert (got["dispatch"], got["on_workers"], got["return"]) == (0.1, 0.3, 0.1)
    assert "dispatch" not in T.load_phases(0.5, 0.01, spans) and "dispatch" not in T.load_phases(0.5, 0.01, [{}],
                                                                                                   (100.0, 100.5))


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



def test_load_partition_without_room_on_the_gpu_names_the_sizes_and_does_not_retry(monkeypatch):
    """A device copy that does not fit the worker's pool is one clear error with the sizes (not a
    retry, not a bare allocator message); on the CPU a MemoryError stays what it is."""
    import beatflow.device as B

    def no_room(x, xp):
        raise MemoryError("std::bad_alloc: out_of_memory: RMM failure at limiting_resource_adaptor.hpp")

    monkeypatch.setattr(T, "to_namespace", no_room)
    monkeypatch.setattr(T, "namespace", lambda device: np)
    monkeypatch.setattr(B, "pool_limit", lambda: (50_000_000, 1_000_000))
    src = _FlakySource(0, None)
    with pytest.raises(DeviceError) as e:
        T.load_partition(1_000_000, src, "gpu")
    assert str(e.value) == ("partition 1000000 (1,000,000 samples) needs 4.0 MB on the GPU, more than this worker's "
                            "RMM pool (limit 0.05 GB, 0.00 GB in use) can give: raise --rmm-pool-size or cut the "
                            "stream into more --partitions")
    assert src.calls == 1
    src = _FlakySource(0, None)
    with pytest.raises(MemoryError):
        T.load_partition(1_000_000, src, "cpu")
    assert src.calls == T.LOAD_ATTEMPTS


@pytest.mark.parametrize("error, converted", [
    (MemoryError("std::bad_alloc"), True),
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("illegal memory access"), False),
    (ValueError("shapes differ"), False),
])
def test_device_memory_converts_only_failed_allocations(monkeypatch, error, converted):
    import beatflow.device as B

    monkeypatch.setattr(B, "pool_limit", lambda: (2_000_000_000, 1_500_000_000))

    def fail():
        with B.device_memory("scoring 1,000 beats", 1_048_576):
            raise error

    if converted:
        with pytest.raises(DeviceError, match=r"^scoring 1,000 beats needs 1\.0 MB on the GPU, more than this "
                                              r"worker's RMM pool \(limit 2\.00 GB, 1\.50 GB in use\) can give"):
            fail()
    else:
        with pytest.raises(type(error)):
            fail()


@pytest.mark.parametrize("seed", range(4))
def test_each_partitions_own_top_snippets_hold_the_whole_streams_top(seed):
    """The report's context comes from each partition's own top beats, cut while scoring: every beat of
    the stream's top (the anomaly table's ranks, ties included) is among its partition's, with the
    signal around it as the whole stream has it (clipped to what the partition sees)."""
    from beatflow.embed.partitions import top_windows
    from beatflow.score.rule import anomaly_table

    rng = np.random.default_rng(seed)
    n, halo, top, pad = 20_000, 300, 12, 250
    x = rng.normal(size=n).astype(np.float32)
    cuts = np.sort(rng.choice(np.arange(1000, n - 1000), size=int(rng.integers(1, 5)), replace=False))
    firsts, ends = np.r_[0, cuts], np.r_[cuts, n]
    starts = np.sort(rng.choice(n - 400, size=600, replace=False))
    lengths = rng.integers(100, 400, starts.size)
    score = rng.integers(0, 40, starts.size).astype(np.float32)  # many ties
    owner = np.searchsorted(ends, starts, side="right")
    table = anomaly_table(np.arange(starts.size), np.zeros(starts.size, int), starts, starts, lengths, score, 250.0,
                          1e9, ["r"])
    pieces = {}
    for k, (a, b) in enumerate(zip(firsts, ends)):
        m = owner == k
        left, right = x[max(0, a - halo):a], x[b:b + halo]
        windows = top_windows(score[m], starts[m], lengths[m], top, pad)
        assert len(windows) == min(top, int(m.sum()))
        pieces[k] = T.partition_snippets(x[a:b], left, right, int(a), windows)
    for _, row in table.nsmallest(top, "rank").iterrows():
        b = int(row["beat"])
        k = int(owner[b])
        lo = max(int(starts[b]) - pad, int(firsts[k]) - halo, 0)
        hi = min(int(starts[b] + lengths[b]) + pad, int(ends[k]) + halo, n)
        got = [p for p in pieces[k] if p[0] == lo and len(p[1]) == hi - lo]
        assert got, f"beat {b} (rank {int(row['rank'])}) has no snippet in partition {k}"
        np.testing.assert_array_equal(got[0][1], x[lo:hi])


def test_api_calls_later_keep_their_order_and_context_and_settle_reports_failures():
    """The UI's API calls made in the background (the training's progress artifact): in the order made, in the
    caller's context (Prefect's settings live in context variables), and every failure reported once settled."""
    import contextvars
    import threading
    import time

    var = contextvars.ContextVar("beatflow_test_var", default="unset")
    var.set("the caller's")
    seen, caller = [], threading.get_ident()

    def call(i, pause=0.0):
        time.sleep(pause)
        seen.append((i, var.get(), threading.get_ident() != caller))

    def fails():
        raise RuntimeError("server said 503")

    T.api_call_later(call, 1, pause=0.05)  # (the slow first call still comes first)
    T.api_call_later(fails)
    T.api_call_later(call, 2)
    assert T.settle_api_calls() == ["RuntimeError: server said 503"]
    assert seen == [(1, "the caller's", True), (2, "the caller's", True)]
    assert T.settle_api_calls() == []  # (each reported once)
    T.api_call_later(time.sleep, 0.5)
    assert T.settle_api_calls(timeout=0.01) == ["1 Prefect API call(s) still running after 0.01 s"]
