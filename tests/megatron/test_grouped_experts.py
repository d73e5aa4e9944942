"""TEGroupedMLP experts at expert tensor parallel (ETP) 2, with the attributes megatron-core 0.18.2 + TransformerEngine
>= 2.13 + megatron-bridge leave on them (tests/megatron/grouped_experts.py): every ETP rank's elements get the keys
of the same elements at TP=1, and the HF keys the bridge's export gives them (megatron-review.md finding 1)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from faircast_plugins.megatron.hf_map import build_element_map  # noqa: E402
from faircast_plugins.megatron.layout import LayoutError, param_keys  # noqa: E402
from tests.megatron import grouped_experts as ge  # noqa: E402
from tests.megatron import hf_converters as conv  # noqa: E402

SIZES = dict(hidden=4, ffn=6, experts=4)
PREFIX = "decoder.layers.0.mlp.experts."


@pytest.fixture
def on_rank(monkeypatch):
    """Run param_keys as expert-parallel rank ``ep_rank`` of ``ep`` would (megatron-core's parallel_state)."""
    from megatron.core import parallel_state as ps

    def set_rank(ep: int, ep_rank: int, etp: int, etp_rank: int) -> None:
        monkeypatch.setattr(ps, "get_expert_model_parallel_rank", lambda: ep_rank)
        monkeypatch.setattr(ps, "get_expert_model_parallel_world_size", lambda: ep)
        monkeypatch.setattr(ps, "get_expert_tensor_parallel_world_size", lambda: etp)
        monkeypatch.setattr(ps, "get_expert_tensor_parallel_rank", lambda: etp_rank)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: etp)
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: etp_rank)

    return set_rank


def _params(model):
    for name, p in model.named_parameters():
        module, _, param = name.rpartition(".")
        yield name, p, module.rsplit(".", 1)[-1], param.rstrip("0123456789"), int(param[len(param.rstrip("0123456789")):])


@pytest.mark.parametrize("te,stamp", [("2.16", True), ("2.12", True), ("2.12", False)],
                         ids=["core0.18.2+TE2.16", "core0.18.2+TE2.12", "core0.16.1+TE2.12"])
@pytest.mark.parametrize("ep", [1, 2])
def test_each_etp_rank_gets_the_tp1_keys_of_its_elements(on_rank, te, stamp, ep):
    """Megatron-native keys: name with the global expert id, index of the element in the full (TP=1) tensor. Over all
    EP x ETP ranks every (name, index) of every expert's tensors is served exactly once (a bias of fc2 once per ETP
    rank: it is replicated, the same bits)."""
    etp = 2
    served = {}
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            on_rank(ep, ep_rank, etp, etp_rank)
            model = ge.moe_model(ep=ep, etp=etp, etp_rank=etp_rank, te=te, stamp=stamp, **SIZES)
            keys = param_keys([model])
            for local_name, p, which, kind, i in _params(model):
                expert = ep_rank * (SIZES["experts"] // ep) + i
                key = keys[id(p)]
                assert key.name == f"{PREFIX}{which}.{kind}{expert}", key
                full = torch.arange(torch.Size(ge.full_shape(which, kind, hidden=4, ffn=6)).numel())
                truth = ge.shard(full.view(ge.full_shape(which, kind, hidden=4, ffn=6)), which, kind, etp, etp_rank)
                assert tuple(truth.shape) == key.local_shape
                got = key.indices(0, key.numel)
                assert torch.equal(got, truth.reshape(-1)), (f"{local_name} at ETP rank {etp_rank}: keyed as TP=1 "
                                                             f"elements {got.tolist()[:8]}..., holds {truth.reshape(-1).tolist()[:8]}...")
                for index in got.tolist():
                    served.setdefault((key.name, index), set()).add(etp_rank)
    for (name, index), ranks in served.items():
        assert len(ranks) == (etp if name.startswith(PREFIX + "linear_fc2.bias") else 1), (name, index, ranks)
    for e in range(SIZES["experts"]):
        for which, kind in (("linear_fc1", "weight"), ("linear_fc1", "bias"), ("linear_fc2", "weight"), ("linear_fc2", "bias")):
            n = torch.Size(ge.full_shape(which, kind, hidden=4, ffn=6)).numel()
            assert sum((f"{PREFIX}{which}.{kind}{e}", j) in served for j in range(n)) == n


def _exported(which: str, kind: str, etp: int, e: int):
    """What the bridge's export makes of the ETP shards (gather over the ETP group, GatedMLPMapping's per-rank gate/up
    split, AutoMapping's row concatenation): ``{HF name: tensor of (rank * 10**6 + local flat index)}``."""
    shape = ge.full_shape(which, kind, hidden=4, ffn=6)
    shards = []
    for r in range(etp):
        local = ge.shard(torch.zeros(shape, dtype=torch.int64), which, kind, etp, r)
        shards.append(torch.arange(local.numel()).view(local.shape) + r * 10**6)
    hf = f"model.layers.0.mlp.experts.{e}."
    if which == "linear_fc1":
        gate = torch.cat([torch.chunk(s, 2, dim=0)[0] for s in shards])
        up = torch.cat([torch.chunk(s, 2, dim=0)[1] for s in shards])
        return {hf + f"gate_proj.{kind}": gate, hf + f"up_proj.{kind}": up}
    return {hf + f"down_proj.{kind}": shards[0] if kind == "bias" else torch.cat(shards, dim=1)}


def _converter(name: str):
    e = int(name[len(name.rstrip("0123456789")):])
    kind = "weight" if ".weight" in name else "bias"
    hf = f"model.layers.0.mlp.experts.{e}."
    if ".linear_fc1." in name:
        return conv.gated(hf + f"gate_proj.{kind}", hf + f"up_proj.{kind}")
    return conv.same(hf + f"down_proj.{kind}")


@pytest.mark.parametrize("etp_rank", [0, 1])
def test_hf_keys_of_each_etp_rank_are_where_the_bridge_exports_its_elements(on_rank, etp_rank):
    etp = 2
    on_rank(1, 0, etp, etp_rank)
    model = ge.moe_model(ep=1, etp=etp, etp_rank=etp_rank, **SIZES)
    keys = param_keys([model])
    for local_name, p, which, kind, e in _params(model):
        key = keys[id(p)]
        emap = build_element_map(key, _converter(key.name))
        got = {}
        for g in emap.groups(key, 0, key.numel):
            pos, hf = g.expand()
            got.update({int(j): (g.name, int(h)) for j, h in zip(pos, hf)})
        want = {}
        source = 0 if (which, kind) == ("linear_fc2", "bias") else etp_rank  # replicated: rank 0's copy is exported
        for hf_name, t in _exported(which, kind, etp, e).items():
            for h, v in enumerate(t.reshape(-1).tolist()):
                if v // 10**6 == source:
                    want[v % 10**6] = (hf_name, h)
        assert got == want, local_name


def test_grouped_layouts_it_cannot_key_are_refused(on_rank):
    on_rank(1, 0, 2, 1)
    model = ge.moe_model(ep=1, etp=2, etp_rank=1, **SIZES)
    model.decoder.layers[0].mlp.experts.linear_fc2.explicit_expert_comm = False  # TE would split it itself
    with pytest.raises(LayoutError, match="explicit_expert_comm"):
        param_keys([model])

    model = ge.moe_model(ep=1, etp=2, etp_rank=1, **SIZES)
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    fc1.register_parameter("weight", torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16)))  # one grouped weight
    with pytest.raises(LayoutError, match="moe_single_grouped_weight"):
        param_keys([model])

    class TEFancyGroupedLinear(ge.TEGroupedLinear):
        pass

    model = ge.moe_model(ep=1, etp=2, etp_rank=1, **SIZES)
    model.decoder.layers[0].mlp.experts.linear_fc1.__class__ = TEFancyGroupedLinear
    with pytest.raises(LayoutError, match="TEFancyGroupedLinear"):
        param_keys([model])


def test_a_param_with_a_partition_dim_but_no_tensor_model_parallel_is_refused_under_tp(on_rank):
    """Any other param whose split the attributes leave uncertain (partition_dim set, tensor_model_parallel False)."""
    on_rank(1, 0, 2, 0)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    model.proj.weight.partition_dim, model.proj.weight.tensor_model_parallel = 1, False
    with pytest.raises(LayoutError, match="partition_dim 1 but tensor_model_parallel"):
        param_keys([model])
    on_rank(1, 0, 1, 0)
    assert param_keys([model])[id(model.proj.weight)].partition_dim == -1  # TP 1: nothing is split

    class TEColumnParallelLinear(torch.nn.Linear):  # a module class megatron-core always splits, unmarked
        pass

    on_rank(1, 0, 2, 0)
    model = torch.nn.Module()
    model.proj = TEColumnParallelLinear(4, 4, bias=False).to(torch.bfloat16)
    with pytest.raises(LayoutError, match="TEColumnParallelLinear.*not marked tensor_model_parallel"):
        param_keys([model])
    model.proj.weight.tensor_model_parallel, model.proj.weight.partition_dim = True, 0
    assert param_keys([model])[id(model.proj.weight)].tp_size == 2


QWEN3_MOE = """
import sys, torch
sys.path.insert(0, {root!r})
import megatron.core.optimizer
from tests.megatron import bridge_stubs
bridge_stubs.import_bridge()
from megatron.core import parallel_state as ps
from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge
from faircast_plugins.megatron.hf_map import build_element_map, converter_lookup, describe
from faircast_plugins.megatron.layout import param_keys
from tests.megatron import grouped_experts as ge
from tests.megatron.test_grouped_experts import _exported, _params, SIZES
import tempfile
torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
lookup = converter_lookup(Qwen3MoEBridge())  # megatron-core's get_pg_size needs an initialized
checked = 0                                                       # process group to report a (probe) group's size
for etp_rank in range(2):
    for f in ("get_expert_tensor_parallel_world_size", "get_tensor_model_parallel_world_size"):
        setattr(ps, f, lambda: 2)
    for f in ("get_expert_tensor_parallel_rank", "get_tensor_model_parallel_rank"):
        setattr(ps, f, lambda r=etp_rank: r)
    ps.get_expert_model_parallel_rank = lambda: 0
    model = ge.moe_model(ep=1, etp=2, etp_rank=etp_rank, bias=False, **SIZES)
    keys = param_keys([model])
    for local_name, p, which, kind, e in _params(model):
        key = keys[id(p)]
        mapping = lookup(key.name)
        module = model.get_submodule(local_name.rsplit(".", 1)[0])
        emap = build_element_map(key, mapping, module)  # runs the mapping's own ETP path on this rank's shard
        got = {{}}
        for g in emap.groups(key, 0, key.numel):
            pos, hf = g.expand()
            got.update({{int(j): (g.name, int(h)) for j, h in zip(pos, hf)}})
        want = {{}}
        for hf_name, t in _exported(which, kind, 2, e).items():
            for h, v in enumerate(t.reshape(-1).tolist()):
                if v // 10**6 == etp_rank:
                    want[v % 10**6] = (hf_name, h)
        assert got == want, (local_name, describe(mapping))
        checked += 1
print("checked", checked)
"""


def test_real_qwen3_moe_bridge_mappings_key_each_etp_shard_as_they_export_it():
    """megatron-bridge's own Qwen3-MoE mappings (GatedMLPMapping, AutoMapping by module class) on the stand-in's
    TEColumnParallelGroupedLinear / TERowParallelGroupedLinear: the attach-time check of the mapping's own ETP path
    passes, and the HF keys are where the export puts each local element."""
    if importlib.util.find_spec("megatron.bridge") is None:
        if os.environ.get("FAIRCAST_EXPECT_MEGATRON_BRIDGE") == "1":
            pytest.fail("megatron-bridge is not installed in this virtualenv")
        pytest.skip("megatron-bridge not installed")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", QWEN3_MOE.format(root=root)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-2:] == ["checked", str(2 * 2 * SIZES["experts"])], proc.stdout
