"""faircast/policy_* views of an FSDP-wrapped policy (faircast_plugins.fsdp_policy), FSDP2 and FSDP1 (use_orig_params
False and True), at world sizes 1 and 2 on gloo: the rows a probe on the sharded model gathers equal a one-process
fp32 reference computed from the full masters and the full served copy (Fair Cast's with it on, round to nearest
with it off), and the measurement leaves every shard and the next forward bit-identical."""
from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from faircast_plugins import FairCaster, FairCastConfig
from faircast_plugins.policy_lag import PolicyLagProbe, served_weight, summarize, weights_swapped
from tests.rank_exit import exit_rank

pytest.importorskip("torch.distributed.fsdp")

VOCAB, DIM, SEED = 33, 16, 7  # 33 rows: uneven shards at world size 2
PROMPT, COMPLETION, SEQS = 4, 5, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h):
        return h + torch.tanh(self.norm(self.lin(h)))


class Tiny(nn.Module):
    """A causal-LM-shaped toy: ``model(input_ids=..., attention_mask=..., use_cache=...)`` -> ``(logits,)``."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        for block in self.layers:
            h = block(h)
        return (self.head(h),)


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    completion_mask = torch.ones(3, COMPLETION, dtype=torch.long)
    completion_mask[1, -2:] = 0
    return dict(prompt_ids=torch.randint(0, VOCAB, (3, PROMPT), generator=g),
                prompt_mask=torch.ones(3, PROMPT, dtype=torch.long),
                completion_ids=torch.randint(0, VOCAB, (3, COMPLETION), generator=g), completion_mask=completion_mask)


def _masters(tied: bool):
    torch.manual_seed(0)
    model = Tiny(tied)
    with torch.no_grad():
        for p in model.parameters():  # off the bf16 grid everywhere (LayerNorm starts at exactly 1 and 0)
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _wrap(model, kind: str, strategy: str = "FULL_SHARD", full_prec_eval: bool = False):
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    saved = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL")
    if full_prec_eval:  # FSDP1 reads it when it wraps: the units' eval-mode unshard in fp32
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=kind == "fsdp1_orig",
                    sharding_strategy=ShardingStrategy[strategy],
                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                   buffer_dtype=torch.float32), device_id=torch.device("cpu"))
    finally:
        if saved is None:
            os.environ.pop("FSDP_USE_FULL_PREC_IN_EVAL", None)
        else:
            os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = saved


def _shards(model) -> list:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
           for p in model.parameters()]
    out += [m._handle.flat_param._local_shard.detach().clone() for m in model.modules()
            if isinstance(m, FSDP) and m._handle is not None]
    return out


def _computed_with(model, ids) -> tuple:
    """One no-grad forward: its output, and ``{parameter name: weight}`` every leaf module computes with (read by a
    forward pre-hook, after FSDP's unshard)."""
    from faircast_plugins.key import canonical_name

    seen, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            def hook(mod, args, prefix=canonical_name(name)):
                for attr in ("weight", "bias"):
                    if getattr(mod, attr, None) is not None:
                        seen.setdefault(f"{prefix}.{attr}", getattr(mod, attr).detach().clone())
            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            out = model(input_ids=ids)[0].float()
    finally:
        for h in handles:
            h.remove()
    return out, seen


def _not_computed_with(seen: dict, case: dict, fair: bool) -> list:
    """The parameters whose weight in ``seen`` is not the served copy of the full fp32 master: Fair Cast's at version
    0 (keyed by the first name of a tied parameter) with ``fair``, round to nearest without."""
    from faircast_plugins.key import canonical_name

    masters = _masters(case["tied"])
    first = {id(p): canonical_name(n) for n, p in masters.named_parameters()}
    caster = FairCaster(FairCastConfig(enabled=True, seed=SEED, mode=case.get("mode", "stochastic")))
    wrong = []
    for name, p in masters.named_parameters(remove_duplicate=False):
        want = caster.cast(first[id(p)], p.detach()) if fair else p.detach().bfloat16()
        if name not in seen or not torch.equal(seen[name], want):
            wrong.append(name)
    return wrong


def _count_full_precision_units(model) -> dict:
    """FSDP1: the most units whose fp32 unsharded flat parameter is allocated at once, seen at each unit's forward."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = [m for m in model.modules() if isinstance(m, FSDP) and m._handle is not None
             and hasattr(m._handle.flat_param, "_full_prec_full_param_padded")]
    out = {"most": 0, "hooks": []}

    def count():
        return sum(int(u._handle.flat_param._full_prec_full_param_padded.untyped_storage().size() > 0) for u in units)

    def seen(module, args):
        out["most"] = max(out["most"], count())

    def seen_after(module, args, output):
        seen(module, args)

    out["count"] = count
    for u in units:
        out["hooks"] += [u.register_forward_pre_hook(seen), u.register_forward_hook(seen_after)]
    return out


def _counted(owner, attr: str) -> dict:
    """Calls of ``owner.attr`` counted (``["n"]``) until ``["undo"]()``."""
    original, out = getattr(owner, attr), {"n": 0}

    def counted(*args, **kwargs):
        out["n"] += 1
        return original(*args, **kwargs)

    setattr(owner, attr, counted)
    out["undo"] = lambda: setattr(owner, attr, original)
    return out


def _count_fsdp2_gathers() -> dict:
    """FSDP2's own all-gathers (its bf16 unshard; none at world size 1)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    return _counted(_fsdp_param_group, "foreach_all_gather")


def _count_group_gathers() -> dict:
    """The probe's fp32 all-gathers of one FSDP2 parameter group each."""
    from faircast_plugins import fsdp_policy

    return _counted(fsdp_policy, "gathered_group")


def _served_against_fsdp(model, views, ids) -> dict:
    """The weight every leaf module computes with in the probe's served forward, against the bf16 bits FSDP's own
    (patched) all-gather gives it in a plain forward: ``served_bits_equal`` (bit for bit, widened) and
    ``served_is_not_master`` (some weight differs from the probe's master view)."""
    leaves = {name: m for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}

    def capture(into):
        def hook(name):
            def seen(mod, args):
                into.setdefault(name, {k: v.detach().clone() for k, v in mod._parameters.items() if v is not None})
            return seen
        return [m.register_forward_pre_hook(hook(name)) for name, m in leaves.items()]

    fsdp_bits, served, master = {}, {}, {}
    with torch.no_grad():
        for into, view in ((served, views.served), (master, views.master)):
            with views.scope(), views.swapped(model, view):
                handles = capture(into)  # after the probe's own hooks: what the module computes with
                model(input_ids=ids)
            for h in handles:
                h.remove()
        handles = capture(fsdp_bits)  # FSDP's own forward: its gathered bf16 weights
        model(input_ids=ids)
        for h in handles:
            h.remove()
    equal = all(torch.equal(fsdp_bits[n][k].float(), served[n][k]) and fsdp_bits[n][k].dtype == torch.bfloat16
                for n in fsdp_bits for k in fsdp_bits[n])
    differs = any(not torch.equal(master[n][k], served[n][k]) for n in served for k in served[n])
    return {"served_bits_equal": equal and set(fsdp_bits) == set(served), "served_is_not_master": differs}


def _measure_case(rank: int, case: dict) -> dict:
    """One case on this rank (inside the process group): wrap, register, measure, and what changed."""
    from faircast_plugins import fsdp
    from faircast_plugins.fsdp_policy import FSDPPolicyViews
    from faircast_plugins.policy_lag import gather_rows

    model = _wrap(_masters(case["tied"]), case["kind"], case.get("strategy", "FULL_SHARD"),
                  case.get("full_prec_eval", False))
    caster = FairCaster(FairCastConfig(enabled=case["on"], seed=SEED, mode=case.get("mode", "stochastic")))
    batch = _batch(rank)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    try:
        if case.get("register_first"):
            fsdp.apply_fsdp_cast_patches()
            fsdp.register_fsdp_module(model, caster)
        with torch.no_grad():  # lazy init; FSDP1 keeps the root unit's round-to-nearest unsharded copy after it
            model(input_ids=ids)  # (SHARD_GRAD_OP: every unit's), FSDP2 the root module's
        if case["on"] and not case.get("register_first"):
            fsdp.apply_fsdp_cast_patches()
            fsdp.register_fsdp_module(model, caster)
        before_out, seen = _computed_with(model, ids)  # the first forward registered computes with Fair Cast's copy
        registered_wrong = _not_computed_with(seen, case, fair=case["on"])
        before = _shards(model)
        probe = PolicyLagProbe(1, SEQS)
        views = FSDPPolicyViews(model)
        model.train()
        full_units = _count_full_precision_units(model)
        from torch.distributed.tensor import DTensor

        full_tensor, fallbacks = DTensor.full_tensor, []
        DTensor.full_tensor = lambda self, *a, **k: fallbacks.append(1) or full_tensor(self, *a, **k)
        fsdp_gathers = _count_fsdp2_gathers()
        group_gathers = _count_group_gathers()
        try:
            with views.scope():
                probe.measure(model, 0, **batch, served=views.served, master=views.master, swap=views.swapped,
                              temperature=0.8)
        finally:
            DTensor.full_tensor = full_tensor
            fsdp_gathers["undo"]()
            group_gathers["undo"]()
        served = _served_against_fsdp(model, views, ids) if case["kind"] == "fsdp2" else {}
        for h in full_units["hooks"]:
            h.remove()
        assert model.training  # the probe put the mode back
        rows = gather_rows(probe.take())
        after = _shards(model)
        with torch.no_grad():
            after_out = model(input_ids=ids)[0].float()
        unregistered_wrong = []
        if case["on"]:  # the forward after it computes with round to nearest again (none of Fair Cast's copy kept)
            fsdp.unregister_fsdp_module(model)
            unregistered_wrong = _not_computed_with(_computed_with(model, ids)[1], case, fair=False)
        return {"rows": rows, "same_shards": all(torch.equal(a, b) for a, b in zip(before, after)),
                "registered_wrong": registered_wrong, "unregistered_wrong": unregistered_wrong,
                "same_forward": torch.equal(before_out, after_out), "dtype": str(before_out.dtype),
                "full_units": full_units["most"], "full_after": full_units["count"](), "fallbacks": len(fallbacks),
                "fsdp_gathers": fsdp_gathers["n"], "group_gathers": group_gathers["n"],
                "per_param_reason": views.per_param_reason, **served}
    finally:
        if case["on"]:
            fsdp.unregister_fsdp_module(model)


def _rank(rank: int, world: int, store: str, outdir: str, cases: list):
    """Every case in turn, in one process group (one spawn per world size)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        out = {_case_id(case): _measure_case(rank, case) for case in cases}
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank()  # no interpreter finalization: a gloo thread alive past destroy_process_group aborted it (CI stop 41)


def _reference(case: dict, world: int, served_on: bool) -> torch.Tensor:
    """Every rank's rows from one process: the unsharded fp32 masters, and each weight's full served copy swapped in
    (Fair Cast of the full master at version 0 with ``served_on``, round to nearest without)."""
    from faircast_plugins.key import canonical_name

    model = _masters(case["tied"])
    caster = FairCaster(FairCastConfig(enabled=True, seed=SEED))
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    served = {id(p): served_weight(p.detach(), enabled=served_on, mode="stochastic", key=caster.key(names[id(p)]))
              for p in model.parameters()}
    probe = PolicyLagProbe(1, SEQS)
    rows = []
    for rank in range(world):
        probe.measure(model, 0, **_batch(rank), served=lambda p: served[id(p)], master=lambda p: None,
                      temperature=0.8, swap=weights_swapped)
        rows.append(probe.take())
    return torch.cat(rows)


CASES = [dict(kind="fsdp2", on=True, tied=False), dict(kind="fsdp2", on=False, tied=True),
         dict(kind="fsdp1", on=True, tied=False), dict(kind="fsdp1_orig", on=False, tied=False),
         # FSDP_USE_FULL_PREC_IN_EVAL=1: FSDP1's eval forward would run on the fp32 masters, the served view too
         dict(kind="fsdp1_orig", on=True, tied=True, full_prec_eval=True),
         dict(kind="fsdp1", on=False, tied=True, full_prec_eval=True),
         # verl's reshard_after_forward: false (FSDP1 keeps every non-root unit unsharded after its forward)
         dict(kind="fsdp1", on=True, tied=False, strategy="SHARD_GRAD_OP"),
         dict(kind="fsdp1_orig", on=False, tied=True, strategy="SHARD_GRAD_OP"),
         dict(kind="fsdp1_orig", on=True, tied=False, strategy="SHARD_GRAD_OP"),  # registered with use_orig_params
         # registered before FSDP1's lazy init (verl's activate), where every other case registers after a forward
         dict(kind="fsdp1", on=True, tied=True, register_first=True)]
#: measured in the same launches, no one-process reference: error feedback's served copy holds state (its residual)
EF_CASE = dict(kind="fsdp2", on=True, tied=False, mode="error_feedback")
_RUNS: dict = {}


def _case_id(case: dict) -> str:
    mode = f"-{case['mode']}" if "mode" in case else ""
    strategy = f"-{case['strategy']}" if "strategy" in case else ""
    full = "-full_prec_eval" if case.get("full_prec_eval") else ""
    first = "-register_first" if case.get("register_first") else ""
    return (f"{case['kind']}{strategy}-{'on' if case['on'] else 'off'}{mode}{'-tied' if case['tied'] else ''}{full}"
            f"{first}")


def _run(case: dict, world: int) -> list:
    """This case's result on every rank; one spawn per world size runs every case (spawns dominate the time)."""
    if world not in _RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), tmp, CASES + [EF_CASE]), nprocs=world)
            _RUNS[world] = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return [results[_case_id(case)] for results in _RUNS[world]]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fsdp_views_equal_the_one_process_reference(case, world):
    ranks = _run(case, world)
    want = _reference(case, world, served_on=case["on"])
    other = _reference(case, world, served_on=not case["on"])  # the copy the adapter must NOT serve
    for res in ranks:
        # registered after a forward (FSDP1 kept the root unit's, under SHARD_GRAD_OP every unit's, unsharded copy;
        # FSDP2 the root module's): the next forward computes with the served copy, and after unregistering with
        # round to nearest again
        assert res["registered_wrong"] == [] and res["unregistered_wrong"] == [], res
        assert res["fallbacks"] == 0  # FSDP2's masters came from one all-gather of the padded shards each
        assert res["same_shards"], "the measurement changed a shard"
        assert res["same_forward"], "the forward after the measurement differs from the one before"
        got = res["rows"]
        assert got.shape == (SEQS * world, 3)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-12), (got, want)
    if case["kind"] == "fsdp2":  # 3 units: FSDP gathers them in bf16 for the served forward only, the master
        # forward once each in fp32 (the root stays unsharded after the served forward; on the old path the master
        # forward gathered the two blocks in bf16 again and each parameter alone in fp32)
        assert all(res["per_param_reason"] is None and res["group_gathers"] == 3
                   and res["fsdp_gathers"] == (3 if world > 1 else 0) for res in ranks), ranks
    if case["kind"].startswith("fsdp1") and world > 1:  # sharded: the master forward gathers fp32 flat params
        # at most the root unit's and the running unit's at once, and none left allocated after the measurement
        # (SHARD_GRAD_OP too, where FSDP1 itself frees no unit after its forward)
        assert all(res["full_units"] in (1, 2) and res["full_after"] == 0 for res in ranks), ranks
    got = summarize(ranks[0]["rows"])
    assert got["faircast/policy_kl"] > 0 and got["faircast/policy_tokens"] == world * (2 * COMPLETION - 2)
    # the check tells the served copy apart: Fair Cast's from round to nearest, and neither is the master
    assert not torch.allclose(ranks[0]["rows"][:, 0], other[:, 0], rtol=1e-3, atol=0)


def test_fsdp2_registered_after_a_forward_casts_the_root_parameters_too():
    """A root FSDP2 module keeps its unsharded parameters registered after a no-grad forward; registering then used
    to miss them silently (their forward kept round to nearest). Now every parameter is registered and cast."""
    from faircast_plugins import fsdp

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            model = _wrap(_masters(False), "fsdp2")
            caster = FairCaster(FairCastConfig(enabled=True, seed=SEED))
            ids = torch.cat([_batch(0)["prompt_ids"], _batch(0)["completion_ids"]], 1)
            with torch.no_grad():
                model(input_ids=ids)  # the root stays unsharded
            fsdp.apply_fsdp_cast_patches()
            registered = fsdp.register_fsdp_module(model, caster)
            assert sorted(registered) == sorted(n for n, _ in _masters(False).named_parameters())
            seen = {}
            model.embed.register_forward_pre_hook(lambda m, a: seen.update(embed=m.weight.detach().clone()))
            with torch.no_grad():
                model(input_ids=ids)
            master = _masters(False).embed.weight.detach()
            assert torch.equal(seen["embed"], caster.cast("embed.weight", master))
            assert not torch.equal(seen["embed"], master.bfloat16())
            fsdp.unregister_fsdp_module(model)
        finally:
            fsdp.remove_fsdp_cast_patches()  # in this process: later tests see torch's own cast sites
            dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "fsdp2"] + [EF_CASE], ids=_case_id)
def test_fsdp2_served_view_is_fsdps_gathered_bits(case, world):
    """The served view is bit for bit what FSDP's own (patched) bf16 all-gather hands every module in a plain
    forward (round to nearest with Fair Cast off, Fair Cast with it on; error feedback, whose served copy is state,
    too), uneven shards at world size 2 included, and the master view (one fp32 all-gather per FSDP2 group) is not
    that copy; error feedback's master forward takes the one-gather path as well."""
    for res in _run(case, world):
        assert res["served_bits_equal"] and res["served_is_not_master"], res
        assert res["registered_wrong"] == [] and res["unregistered_wrong"] == [], res
        assert res["same_shards"] and res["same_forward"], res
        assert res["per_param_reason"] is None and res["group_gathers"] == 3, res
        assert res["fsdp_gathers"] == (3 if world > 1 else 0), res
        assert res["fallbacks"] == 0 and torch.isfinite(res["rows"]).all() and res["rows"].shape == (SEQS * world, 3)
