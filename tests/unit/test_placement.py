"""The policy workers' placement group (rl/runtime/placement.py): one bundle per worker, and the check that tells at
once, in one line, when the cluster's nodes can never hold the group under the chosen strategy. (The group
itself, on a real Ray: tests/integration/test_data_parallel_run.py.)"""

from rl.runtime.placement import cannot_hold, worker_bundle

ONE_NODE = {"10.0.0.1": {"CPU": 2.0, "memory": 1e9}}
TWO_GPU_NODES = {"10.0.0.1": {"CPU": 8.0, "GPU": 1.0}, "10.0.0.2": {"CPU": 8.0, "GPU": 1.0}}


def test_a_bundle_is_the_workers_device_and_cpus():
    assert worker_bundle("cuda", 4) == {"GPU": 1.0, "CPU": 4.0}
    assert worker_bundle("cuda", 0) == {"GPU": 1.0}
    assert worker_bundle("cpu", 0.5) == {"CPU": 0.5}
    assert worker_bundle("cpu", 0) is None  # nothing to reserve: no group


def test_pack_and_spread_fit_when_the_nodes_hold_every_bundle():
    assert cannot_hold(2, {"CPU": 1.0}, "PACK", ONE_NODE) is None
    assert cannot_hold(4, {"CPU": 0.5}, "SPREAD", ONE_NODE) is None  # fractional CPUs add up
    why = cannot_hold(3, {"CPU": 1.0}, "PACK", ONE_NODE)
    assert why == "3 x {CPU: 1} do not fit: the cluster's 1 node(s) have {CPU: 2} in all and hold 2"
    assert cannot_hold(2, {"GPU": 1.0, "CPU": 8.0}, "PACK", TWO_GPU_NODES) is None
    assert "hold 2" in cannot_hold(3, {"GPU": 1.0, "CPU": 1.0}, "SPREAD", TWO_GPU_NODES)
    assert "{GPU: 0, CPU: 2}" in cannot_hold(1, {"GPU": 1.0, "CPU": 1.0}, "PACK", ONE_NODE)  # no GPU at all


def test_strict_strategies_count_nodes():
    assert cannot_hold(2, {"GPU": 1.0}, "STRICT_SPREAD", TWO_GPU_NODES) is None
    assert cannot_hold(2, {"CPU": 1.0}, "STRICT_SPREAD", ONE_NODE) == \
        "STRICT_SPREAD needs 2 nodes that each hold {CPU: 1}; the cluster has 1"
    assert cannot_hold(2, {"CPU": 1.0}, "STRICT_PACK", ONE_NODE) is None
    assert cannot_hold(2, {"GPU": 1.0}, "STRICT_PACK", TWO_GPU_NODES) == \
        "STRICT_PACK needs one node that holds 2 x {GPU: 1}; the largest holds 1"
