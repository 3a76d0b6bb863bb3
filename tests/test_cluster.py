"""Cluster plumbing: RMM pool sizes as dask-cuda reads them, and a cluster without workers."""
import pytest

from beatflow.errors import DeviceError, InputError
from tasks.cluster import parse_pool_size, wait_for_workers


@pytest.mark.parametrize("value, want", [("80%", 0.8), (0.8, 0.8), ("0.5", 0.5), ("100%", 1.0), ("40GB", "40GB"),
                                         (2e9, 2_000_000_000), ("3000000000", 3_000_000_000)])
def test_pool_size_in_dask_cuda_terms(value, want):
    got = parse_pool_size(value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value", ["lots", "-5%", "150%", 0, -1.0, "0GB"])
def test_bad_pool_size_is_an_input_error(value):
    with pytest.raises(InputError, match="rmm-pool-size"):
        parse_pool_size(value)


def test_cluster_without_workers_is_an_error_not_a_hang():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster):
        with pytest.raises(DeviceError, match="0 of 1 workers after 2 s"):
            wait_for_workers(1, timeout=2)
