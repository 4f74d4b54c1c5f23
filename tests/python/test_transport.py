# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""UlyssesGroup's transport decision (fastcomms.ulysses.nvlink_decision) on made-up worlds: the
same entries give every rank the same answer, and "unknown" is never taken for yes."""

from fastcomms.ulysses import nvlink_decision


def _nvml(joined):
    calls = []

    def query(devices):
        calls.append(list(devices))
        if joined is None:
            return None, "NVML is not available"
        return {(a, b): joined(a, b) for a in devices for b in devices if a != b}, ""

    return query, calls


def test_one_host_all_pairs_joined():
    query, calls = _nvml(lambda a, b: True)
    ok, why = nvlink_decision(["h|0", "h|1", "h|2", "h|3"], query)
    assert ok and "every pair NVLink-joined" in why and calls == [[0, 1, 2, 3]]


def test_ranks_sharing_one_gpu_need_no_nvml():
    query, calls = _nvml(None)
    ok, why = nvlink_decision(["h|0", "h|0", "h|0"], query)
    assert ok and "share GPU 0" in why and calls == []


def test_two_hosts_fall_back():
    query, _ = _nvml(lambda a, b: True)
    ok, why = nvlink_decision(["a|0", "b|0"], query)
    assert not ok and why == "the ranks span 2 hosts"


def test_unknown_is_never_yes():
    query, _ = _nvml(None)
    ok, why = nvlink_decision(["h|0", "h|1"], query)
    assert not ok and "NVML cannot say" in why and "NVML is not available" in why


def test_a_missing_pair_is_named():
    query, _ = _nvml(lambda a, b: {a, b} != {1, 2})
    ok, why = nvlink_decision(["h|0", "h|1", "h|2", "h|1"], query)
    assert not ok and why == "GPU pairs [(1, 2)] are not NVLink-joined"


def test_order_of_entries_does_not_matter():
    query, _ = _nvml(lambda a, b: {a, b} != {0, 3})
    a = nvlink_decision(["h|3", "h|0", "h|1"], query)
    b = nvlink_decision(["h|0", "h|1", "h|3"], query)
    assert a == b and not a[0]
