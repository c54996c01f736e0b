"""Where the PolicyWorkers run on a Ray cluster: a placement group of one bundle per worker (issue #17).

Each worker's bundle is what its actor asks for: {"GPU": 1, "CPU": runtime.cpus_per_worker} with run.device
cuda, {"CPU": runtime.cpus_per_worker} on CPU. Rank r's actor is scheduled into bundle r, so the group reserves
every worker's device before any worker starts, all or nothing (never 3 of 4 workers up while the 4th waits
forever for a GPU). `runtime.placement_strategy` is Ray's:

    PACK (default)   as few nodes as possible, more when one does not hold them all: workers of one node share
                     its interconnect (NVLink within a host), and the process group's collectives stay there
    SPREAD           over as many nodes as possible (soft)
    STRICT_PACK      all on one node, or the job does not start
    STRICT_SPREAD    one worker per node, or the job does not start

Before waiting, `cannot_hold` compares the bundles with the resources of the cluster's live nodes (bundles are
identical, so this is exact: node i holds floor(min_r total_i[r] / bundle[r]) of them); a group that no
assignment fits fails at once with one line naming what is missing. A group that fits but does not become
ready (other jobs hold the resources) fails after runtime.worker_start_timeout_s, naming what is free. An
autoscaling cluster's nodes must therefore be up when the job starts.

CPU workers with cpus_per_worker 0 reserve nothing (Ray has no empty bundle): they are placed without a group.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping


class PlacementError(RuntimeError):
    """The cluster cannot hold the policy workers, or did not free room for them in time (one line)."""


def worker_bundle(device: str, cpus_per_worker: float) -> dict[str, float] | None:
    """One worker's bundle, or None when it reserves nothing (CPU workers of 0 CPUs)."""
    bundle = {"GPU": 1.0} if device == "cuda" else {}
    if cpus_per_worker > 0:
        bundle["CPU"] = float(cpus_per_worker)
    return bundle or None


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _holds(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many bundles a node's resources hold (float resources: 0.5 CPU twice in 1 CPU)."""
    return min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())


def cannot_hold(n: int, bundle: Mapping[str, float], strategy: str, nodes: Mapping[str, Mapping[str, float]]) -> str | None:
    """Why nodes {address: total resources} can never place `n` identical bundles under `strategy`, or None."""
    holds = {ip: _holds(res, bundle) for ip, res in nodes.items()}
    if strategy == "STRICT_SPREAD":
        fit = sum(1 for h in holds.values() if h >= 1)
        if fit < n:
            return f"STRICT_SPREAD needs {n} nodes that each hold {_fmt(bundle)}; the cluster has {fit}"
        return None
    if strategy == "STRICT_PACK":
        best = max(holds.values(), default=0)
        if best < n:
            return f"STRICT_PACK needs one node that holds {n} x {_fmt(bundle)}; the largest holds {best}"
        return None
    if sum(holds.values()) < n:
        totals = {k: sum(res.get(k, 0.0) for res in nodes.values()) for k in bundle}
        return (f"{n} x {_fmt(bundle)} do not fit: the cluster's {len(nodes)} node(s) have {_fmt(totals)} in all "
                f"and hold {sum(holds.values())}")
    return None


def reserve(n: int, bundle: dict[str, float], strategy: str, timeout_s: float):
    """A ready placement group of `n` copies of `bundle` (Ray must be initialised); PlacementError otherwise."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = {node["NodeManagerAddress"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
    why = cannot_hold(n, bundle, strategy, nodes)
    if why is not None:
        raise PlacementError(f"the Ray cluster cannot hold {n} policy workers (placement group, runtime.placement_strategy "
                             f"{strategy}): {why}; lower runtime.num_workers or runtime.cpus_per_worker, or add nodes")
    group = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    if not group.wait(timeout_s):
        free = {k: ray.available_resources().get(k, 0.0) for k in bundle}
        remove_placement_group(group)
        raise PlacementError(f"the placement group of {n} policy workers x {_fmt(bundle)} ({strategy}) was not ready "
                             f"within {timeout_s:g} s (runtime.worker_start_timeout_s): the cluster has {_fmt(free)} free; "
                             "other jobs hold the rest")
    return group


def actor_options(group, rank: int) -> dict:
    """Ray actor options that put rank `rank` into its bundle of `group` (None: no group, Ray's default)."""
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=rank)}


def release(group) -> None:
    """Give the group's resources back (the job's end; a Ray the job did not start lives on)."""
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)


def node_ip() -> str | None:
    """This process's node address as Ray knows it (None outside Ray: the in-process runtime runs without Ray
    installed, and a process that never imported Ray cannot be in one: it is not imported for the question)."""
    ray = sys.modules.get("ray")
    return ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else None
