"""The FSDP cast sites' cost (issue #20): one batched cast per parameter group per all-gather (finding 6), offloaded
host shards cast on the device of the buffer they fill (finding 5, a mocked device), and the stateful export's
bf16 all-gather (finding 9, two gloo ranks). Bits are checked against ``caster.cast`` of the full master."""
from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from faircast_plugins import FairCaster, FairCastConfig, cast as cast_module
from faircast_plugins import fsdp

pytest.importorskip("torch.distributed.fsdp")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


@pytest.fixture
def world_of_one():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture
def engine_runs(monkeypatch):
    """Calls of the rounding engine's internal run function, with the devices of the tensors it cast."""
    calls = []
    original = cast_module._run

    def counting(items, mode, backend):
        calls.append([item.x.device for item in items])
        return original(items, mode, backend)

    monkeypatch.setattr(cast_module, "_run", counting)
    return calls


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))


def _sharded(register: bool, config: FairCastConfig):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fsdp.apply_fsdp_cast_patches()
    model = _model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)  # one group: all six parameters
    caster = FairCaster(config)
    if register:
        fsdp.register_fsdp_module(model, caster)
    model(torch.randn(2, 24))  # lazy init (mixed-precision dtypes)
    model.reshard()  # the root stays unsharded after its forward
    (group,) = fsdp._param_groups(model._get_fsdp_state())
    return model, caster, group


def _all_gather_inputs(group):
    """The fast path FSDP2 runs once per all-gather at world size > 1 (called directly: gloo world of one)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives._get_param_all_gather_inputs(group.fsdp_params)


def test_one_engine_run_per_group_per_all_gather_with_the_full_master_bits(world_of_one, engine_runs, monkeypatch):
    model, caster, group = _sharded(True, FairCastConfig(enabled=True, seed=5))
    hashed = []
    key = caster.key
    monkeypatch.setattr(caster, "key", lambda name: hashed.append(name) or key(name))
    engine_runs.clear()
    n = len(group.fsdp_params)
    for version in range(2):
        for _ in range(2):  # two all-gathers at one version (forward and backward with reshard_after_forward)
            before = len(engine_runs)
            inputs = _all_gather_inputs(group)
            assert len(engine_runs) - before == 1 and len(engine_runs[-1]) == n == 6
            for fsdp_param, ins in zip(group.fsdp_params, inputs):
                name = getattr(fsdp_param, fsdp._ATTR).name
                master = fsdp_param._sharded_param_data[: fsdp_param.sharded_param.numel()]
                assert torch.equal(bits(ins[0][: master.numel()]), bits(FairCaster(caster.config, version=version)
                                                                         .cast(name, master)))
        # keys: once per parameter per version, not per all-gather (version 0's at the lazy-init forward)
        assert len(hashed) == n * version
        caster.advance()
    stochastic = _all_gather_inputs(group)
    assert any(not torch.equal(bits(ins[0][: p.sharded_param.numel()]), bits(p._sharded_param_data[: p.sharded_param.numel()].bfloat16()))
               for p, ins in zip(group.fsdp_params, stochastic))  # the check can tell Fair Cast from nearest


def test_flag_off_and_unregistered_keep_round_to_nearest(world_of_one, engine_runs):
    for register, config in ((True, FairCastConfig(enabled=False)), (False, FairCastConfig(enabled=True))):
        model, caster, group = _sharded(register, config)
        engine_runs.clear()
        inputs = _all_gather_inputs(group)
        assert len(engine_runs) == (1 if register else 0)
        for p, ins in zip(group.fsdp_params, inputs):
            numel = p.sharded_param.numel()
            assert torch.equal(bits(ins[0][:numel]), bits(p._sharded_param_data[:numel].bfloat16()))
        fsdp.unregister_fsdp_module(model)


def test_world_of_one_property_path_casts_each_parameter(world_of_one, engine_runs):
    model, caster, group = _sharded(True, FairCastConfig(enabled=True, seed=5))
    engine_runs.clear()
    for p in group.fsdp_params:
        q = p.all_gather_inputs[0]
        numel = p.sharded_param.numel()
        assert torch.equal(bits(q[:numel]), bits(caster.cast(p._faircast_cast.name, p._sharded_param_data[:numel])))
    assert len(engine_runs) == 2 * len(group.fsdp_params)  # its own cast, and the reference's


# -- finding 5: a shard on the host is cast on the device of the buffer it fills (meta stands in for CUDA) ----------


@pytest.fixture
def batched_on(monkeypatch):
    """fair_cast_many as the cast sites call it, recording the devices (the kernels cannot run on meta tensors)."""
    seen = []

    def record(xs, *, keys, offsets, mode, backend, outs):
        seen.append({"x": {x.device.type for x in xs}, "out": {o.device.type for o in outs}, "n": len(xs),
                     "keys": list(keys), "offsets": list(offsets)})
        return outs

    monkeypatch.setattr(fsdp, "fair_cast_many", record)
    moved = []
    to_device = fsdp._to_device
    monkeypatch.setattr(fsdp, "_to_device", lambda t, d: moved.append((t.device.type, torch.device(d).type)) or to_device(t, d))
    return seen, moved


def _fake_offloaded_param(caster, name, numel):
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    host = torch.randn(numel + 2)  # padded, as FSDP2 keeps it
    return SimpleNamespace(sharded_state=ShardedState.SHARDED, _sharded_local_tensor=host, _sharded_param_data=host,
                           offload_to_cpu=True, **{fsdp._ATTR: fsdp._ParamCast(caster, name, 0, numel)})


def test_fsdp2_offloaded_shards_are_cast_on_the_destination_device(batched_on, engine_runs):
    seen, moved = batched_on
    caster = FairCaster(FairCastConfig(enabled=True, seed=1))
    params = [_fake_offloaded_param(caster, f"w{i}", 5 + i) for i in range(3)]
    fast_path = fsdp._wrap_get_param_all_gather_inputs(
        lambda ps: [[torch.empty(p._sharded_param_data.numel(), dtype=torch.bfloat16, device="meta")] for p in ps])
    fast_path(params)
    assert seen == [{"x": {"meta"}, "out": {"meta"}, "n": 3, "keys": [caster.key(f"w{i}") for i in range(3)],
                     "offsets": [0, 0, 0]}]
    assert moved == [("cpu", "meta")] * 3
    assert engine_runs == []  # nothing was cast on the host


def test_fsdp1_offloaded_flat_shard_moves_once_and_casts_on_the_device(batched_on):
    seen, moved = batched_on
    caster = FairCaster(FairCastConfig(enabled=True, seed=1))
    infos = [SimpleNamespace(in_shard=True, numel_in_shard=4, offset_in_shard=0, intra_param_start_idx=2),
             SimpleNamespace(in_shard=True, numel_in_shard=6, offset_in_shard=4, intra_param_start_idx=0)]
    flat = SimpleNamespace(_mp_shard=torch.empty(10, dtype=torch.bfloat16, device="meta"), _local_shard=torch.randn(10),
                           _shard_param_infos=infos)
    handle = SimpleNamespace(flat_param=flat, **{fsdp._ATTR: fsdp._HandleCast(caster, ["a", "b"])})
    fsdp._wrap_use_low_precision_shard(lambda self: None)(handle)
    assert moved[0] == ("cpu", "meta") and len(moved) == 3  # the whole flat shard once (then no-op moves)
    assert seen == [{"x": {"meta"}, "out": {"meta"}, "n": 2, "keys": [caster.key("a"), caster.key("b")],
                     "offsets": [2, 0]}]


def test_error_feedback_stays_with_its_host_residual(batched_on, engine_runs):
    seen, moved = batched_on
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback"))
    param = _fake_offloaded_param(caster, "w", 6)
    out = torch.empty(8, dtype=torch.bfloat16, device="meta")
    fsdp._cast_into([fsdp._fsdp2_job(param, [out])])
    assert seen == [] and engine_runs == [[torch.device("cpu")]]  # cast on the host, where its residual lives
    assert caster._ef["w"].residual.device.type == "cpu"


def test_same_device_cast_is_written_into_the_buffer(engine_runs):
    caster = FairCaster(FairCastConfig(enabled=True, seed=2))
    master, out = torch.randn(7), torch.zeros(9, dtype=torch.bfloat16)
    fsdp._cast_into([fsdp._Job(caster, fsdp._KeyCache(), "w", 3, master, out[:7])])
    assert torch.equal(bits(out[:7]), bits(caster.cast("w", master, offset=3)))
    assert torch.equal(bits(out[7:]), bits(torch.zeros(2, dtype=torch.bfloat16)))  # padding untouched


# -- finding 9: the stateful export all-gathers bf16 shards (two gloo ranks) -----------------------------------------

# (name, full numel, {rank: (offset, numel)}): FSDP2's dim-0 chunks, an FSDP1-like split, a rank holding none,
# replicated shards (HSDP-like).
LAYOUTS = [
    ("chunks", 10, {0: (0, 5), 1: (5, 5)}),
    ("uneven", 10, {0: (0, 7), 1: (7, 3)}),
    ("reversed", 9, {0: (4, 5), 1: (0, 4)}),
    ("one_rank", 6, {0: (0, 6)}),
    ("replicated", 8, {0: (0, 8), 1: (0, 8)}),
]


def _assemble_by_max_all_reduce(caster, name, shard, shape, device):
    """The export as of 81b1184 (reference for the bits): an int32 MAX all-reduce of ``bits + 1``."""
    numel = int(torch.tensor(shape).prod())
    buf = torch.zeros(numel, dtype=torch.int32, device=device)
    if shard is not None:
        offset, master = shard
        q = caster.cast(name, master, offset=offset)
        buf[offset: offset + q.numel()] = q.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF) + 1
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    b = buf - 1
    return torch.where(b >= 32768, b - 65536, b).to(torch.int16).view(torch.bfloat16).view(shape)


def _spawn_and_collect(fn, nprocs: int) -> dict:
    """Run ``fn(rank, store, outdir)`` on ``nprocs`` spawned ranks; ``{rank: what it saved}``. Through files, not a
    multiprocessing Manager: its server is forked from this (threaded) pytest process and once hung a CI run."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(os.path.join(tmp, "store"), tmp), nprocs=nprocs)
        return {r: torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(nprocs)}


def _export_rank(rank, store, outdir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    fulls = {name: torch.randn(n) * 1e-2 for name, n, _ in LAYOUTS}
    fulls["chunks"][:4] = torch.tensor([-0.0, float("inf"), float("-inf"), 1e-40])
    calls = []
    originals = {}
    for fn in ("all_reduce", "all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, fn):
            originals[fn] = getattr(dist, fn)

            def counted(*args, _fn=fn, **kwargs):
                calls.append((_fn, sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))))
                return originals[_fn](*args, **kwargs)

            setattr(dist, fn, counted)
    out = {}
    for mode in ("error_feedback", "stochastic"):
        config = FairCastConfig(enabled=True, mode=mode, seed=4)
        caster, old_caster = FairCaster(config), FairCaster(config)
        per_export = []
        for version in range(3):
            for name, n, layout in LAYOUTS:
                got = layout.get(rank)
                shard = None if got is None else (got[0], fulls[name][got[0]: got[0] + got[1]])
                calls.clear()
                q = fsdp.assemble_served(caster, name, shard, (n,), "cpu")
                per_export.append((version, name, list(calls)))
                calls.clear()
                old = _assemble_by_max_all_reduce(old_caster, name, shard, (n,), "cpu")
                full = FairCaster(config, version=version).cast(name, fulls[name]) if mode != "error_feedback" else None
                out[(mode, version, name)] = (bits(q).tolist(), bits(old).tolist(),
                                              None if full is None else bits(full).tolist())
            caster.advance()
            old_caster.advance()
            for name in fulls:
                fulls[name] = fulls[name] + 3e-4  # the optimizer step
        out[(mode, "calls")] = per_export
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_exports():
    return _spawn_and_collect(_export_rank, 2)


def test_export_bits_equal_the_max_all_reduce_and_the_full_cast(two_rank_exports):
    for rank in (0, 1):
        for key, value in two_rank_exports[rank].items():
            if key[1] == "calls":
                continue
            new, old, full = value
            assert new == old, key
            assert full is None or new == full, key
            assert new == two_rank_exports[0][key][0]  # every rank has the same copy


def test_export_moves_bf16_once_per_parameter_after_the_first(two_rank_exports):
    for mode in ("error_feedback", "stochastic"):
        for version, name, calls in two_rank_exports[0][(mode, "calls")]:
            numel = next(n for nm, n, _ in LAYOUTS if nm == name)
            width = max(n for _, n in dict(next(lay for nm, _, lay in LAYOUTS if nm == name)).values())
            kinds = [fn for fn, _ in calls]
            assert "all_reduce" not in kinds
            data = [(fn, b) for fn, b in calls][-1]
            assert data[1] == 3 * width * 2  # in + out tensors of the bf16 all-gather: 2 B per element
            assert len(calls) == (2 if version == 0 else 1), (mode, version, name, calls)  # layout once, then bits
            assert width * 2 <= numel * 2  # never more than the bf16 tensor per rank


# -- issue 29, finding 7: under HSDP the stateful export gathers over one replica's shard group (four gloo ranks) --

HSDP_LAYOUTS = [("chunks", 10, {0: (0, 5), 1: (5, 5)}), ("uneven", 10, {0: (0, 7), 1: (7, 3)})]


def _hsdp_rank(rank, store, outdir):
    """A 2x2 mesh: replicas {0, 1} and {2, 3}, each sharding every parameter over its two ranks."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    shard_group = groups[rank // 2]
    torch.manual_seed(0)
    fulls = {name: torch.randn(n) * 1e-2 for name, n, _ in HSDP_LAYOUTS}
    gathers = []
    for fn in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, fn):
            real = getattr(dist, fn)

            def counted(output, tensor, *args, _real=real, **kwargs):
                gathers.append((dist.get_world_size(kwargs.get("group")), output.numel() * output.element_size()))
                return _real(output, tensor, *args, **kwargs)

            setattr(dist, fn, counted)
    out = {}
    for mode in ("error_feedback", "stochastic"):
        config = FairCastConfig(enabled=True, mode=mode, seed=4)
        caster = FairCaster(config)
        for version in range(2):
            for name, n, layout in HSDP_LAYOUTS:
                offset, numel = layout[rank % 2]
                q = fsdp.assemble_served(caster, name, (offset, fulls[name][offset: offset + numel]), (n,), "cpu",
                                         group=shard_group)
                full = FairCaster(config, version=version).cast(name, fulls[name]) if mode == "stochastic" else None
                out[(mode, version, name)] = (bits(q).tolist(), None if full is None else bits(full).tolist())
            caster.advance()
    out["gathers"] = gathers
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def hsdp_exports():
    return _spawn_and_collect(_hsdp_rank, 4)


def test_hsdp_export_gathers_over_the_shard_group_only(hsdp_exports):
    """Every rank of both replicas assembles the same served copy (stochastic: ``fair_cast`` of the full master),
    and every gather runs over the two ranks of its replica, not all four: each replica's bf16 shards cross only
    its own links (before: every gather over the world, the replicas resending the same shards)."""
    for rank in range(4):
        for key, value in hsdp_exports[rank].items():
            if key == "gathers":
                assert value and all(world == 2 for world, _ in value), value
                continue
            got, full = value
            assert got == hsdp_exports[0][key][0], (rank, key)
            assert full is None or got == full, (rank, key)
