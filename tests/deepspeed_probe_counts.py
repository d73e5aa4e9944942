"""Counters a DeepSpeed policy-probe test worker puts around the views' entry points (TRL's ds_grpo.py and OpenRLHF's
openrlhf_actor_worker.py): how many master windows were loaded, how many parameters took the per-parameter master
path, how many module gathers ZeRO-3's coordinator ran, and how many master / served layouts the views built. The
wrappers stay for the process's life."""
from __future__ import annotations

from typing import Dict


def _counted(counts: Dict[str, int], owner, attr: str, key: str) -> None:
    inner = getattr(owner, attr)

    def call(*args, **kwargs):
        counts[key] += 1
        return inner(*args, **kwargs)

    setattr(owner, attr, call)


def _counted_layouts(counts: Dict[str, int], cls) -> None:
    inner = cls.__init__

    def init(self, *args, **kwargs):
        served = kwargs.get("served", args[1] if len(args) > 1 else False)
        counts["served_layouts" if served else "master_layouts"] += 1
        inner(self, *args, **kwargs)

    cls.__init__ = init


def count_probe_calls() -> Dict[str, int]:
    """Wrap the entry points; returns the live counts (``window_loads``, ``per_parameter_masters``,
    ``deepspeed_fetches``, and the layouts built: ``master_layouts``, ``served_layouts``)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from faircast_plugins.deepspeed import master_windows, policy_views

    counts = {"window_loads": 0, "per_parameter_masters": 0, "deepspeed_fetches": 0, "master_layouts": 0,
              "served_layouts": 0}
    _counted_layouts(counts, master_windows.Zero12Layout)
    _counted_layouts(counts, master_windows.Zero3Layout)
    _counted(counts, master_windows.Zero12Layout, "load", "window_loads")
    _counted(counts, master_windows.Zero3Layout, "load", "window_loads")
    _counted(counts, policy_views, "master_view", "per_parameter_masters")  # the per-parameter path
    _counted(counts, PartitionedParameterCoordinator, "fetch_sub_module", "deepspeed_fetches")  # ZeRO-3's gathers
    return counts
