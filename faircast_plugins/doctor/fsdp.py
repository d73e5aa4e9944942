"""Doctor check ``fsdp``: torch FSDP2's patched bf16 cast, in-process at world size 1 on CPU.

A tiny two-layer model is wrapped with ``fully_shard`` (bf16 compute copy) and registered with a caster; two SGD
steps run. Every forward must compute with ``fair_cast(fp32 master)`` at the current weight version.
"""
from __future__ import annotations

from typing import List

from . import SEED, check_served, expect, world_of_one

STEPS = 2


def _tiny_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24))


def sharded_forwards(device: str = "cpu", *, faircast: bool = True) -> List[tuple]:
    """Two SGD steps of the tiny model under ``fully_shard`` (bf16 compute copy) on ``device``, in the caller's process
    group, with its parameters registered with a caster when ``faircast``: (name, weight the forward computes with,
    its sharded fp32 master, weight version) for every parameter read in the forwards. Also run on CUDA by
    benchmarks/gpu/adapters.py (flag off: its control)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..caster import FairCaster
    from ..config import FairCastConfig
    from ..fsdp import register_fsdp_module, unregister_fsdp_module

    model = _tiny_model().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh(torch.device(device).type, (1,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    names = {id(p): n for n, p in model.named_parameters()}  # the sharded (DTensor) parameters
    caster = FairCaster(FairCastConfig(enabled=True, seed=SEED))
    if faircast:
        register_fsdp_module(model, caster)
    seen = []  # (name, weight the forward computes with, version)

    def record(module, args):
        for local, p in module.named_parameters(recurse=False):
            seen.append((f"{module_names[module]}.{local}", p.detach().clone(), caster.version))

    module_names = {model[0]: "0", model[2]: "2"}
    hooks = [m.register_forward_pre_hook(record) for m in module_names]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(1)).to(device)
    masters = []
    try:
        for _ in range(STEPS):
            masters.append({names[id(p)]: p.to_local().detach().clone() for p in model.parameters()})
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            caster.advance()
    finally:
        for h in hooks:
            h.remove()
        if faircast:
            unregister_fsdp_module(model)
    expect(caster.version == STEPS, f"weight version {caster.version} after {STEPS} steps")
    return [(name, weight, masters[version][name], version) for name, weight, version in seen]


def check() -> List[str]:
    from ..fsdp import apply_fsdp_cast_patches

    with world_of_one():
        patches = apply_fsdp_cast_patches()
        seen = sharded_forwards("cpu")  # on the CPU on a GPU machine too
        expect(len(seen) == 4 * STEPS, f"expected {4 * STEPS} parameter reads in the forwards, saw {len(seen)}")
        distinct = False
        for name, weight, master, version in seen:
            distinct |= check_served("FSDP2 forward", name, weight, master, version)
        expect(distinct, "the served copies equal round-to-nearest everywhere: the check cannot tell them apart")
    return [f"torch {patches.version}{'' if patches.verified else ' (UNVERIFIED)'}: {len(seen)} FSDP2 forward "
            f"weights over {STEPS} steps are fair_cast(master) bit for bit"]
