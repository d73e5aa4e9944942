"""faircast/policy_*: per-token KL and sequence ESS/n between the served copy and the master (policy_lag.py)."""
import math

import pytest
import torch

from faircast_plugins.config import FairCastConfig
from faircast_plugins.policy_lag import (
    ESS_KEY, KL_KEY, LOG_RATIO_STD_KEY, SEQS_KEY, TOKENS_KEY, PolicyLagProbe, metrics_of, sequence_stats,
    served_weight, summarize, weights_swapped,
)

VOCAB, HIDDEN = 11, 8


class TinyLM(torch.nn.Module):
    """Embedding -> tanh(Linear) -> head tied to the embedding: logits from the module's own weights only."""

    def __init__(self, seed=0):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": VOCAB})()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as in SmolLM2
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 2)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h = torch.tanh(self.mix(self.embed(input_ids)))
        return type("Out", (), {"logits": self.head(h)})()


def _bf16(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _batch(seqs=4, prompt=3, completion=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, VOCAB, (seqs, prompt), generator=g)
    completion_ids = torch.randint(0, VOCAB, (seqs, completion), generator=g)
    completion_mask = torch.ones(seqs, completion, dtype=torch.long)
    completion_mask[1, 3:] = 0  # a shorter sequence: its padding does not count
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask


def _hand(served_model, master_model, prompt_ids, completion_ids, completion_mask, temperature):
    """The metrics, one token at a time in Python floats (math.exp/log), from each model's logits."""
    kl_sum, tokens, log_w = 0.0, 0, []
    for i in range(prompt_ids.shape[0]):
        ids = torch.cat([prompt_ids[i], completion_ids[i]])[None]
        ls = served_model(ids).logits[0].double().tolist()
        lm = master_model(ids).logits[0].double().tolist()
        s_i = 0.0
        for t in range(completion_ids.shape[1]):
            if not completion_mask[i, t]:
                continue
            pos = prompt_ids.shape[1] + t - 1  # the logits that predict completion token t
            zs = [x / temperature for x in ls[pos]]
            zm = [x / temperature for x in lm[pos]]
            ns = math.log(sum(math.exp(z) for z in zs))
            nm = math.log(sum(math.exp(z) for z in zm))
            ps = [math.exp(z - ns) for z in zs]
            kl_sum += sum(p * ((a - ns) - (b - nm)) for p, a, b in zip(ps, zs, zm))
            y = int(completion_ids[i, t])
            s_i += (zm[y] - nm) - (zs[y] - ns)
            tokens += 1
        log_w.append(s_i)
    w = [math.exp(x) for x in log_w]
    mean = sum(log_w) / len(log_w)
    return {KL_KEY: kl_sum / tokens, ESS_KEY: sum(w) ** 2 / (len(w) * sum(x * x for x in w)),
            LOG_RATIO_STD_KEY: math.sqrt(sum((x - mean) ** 2 for x in log_w) / len(log_w)),
            SEQS_KEY: float(len(w)), TOKENS_KEY: float(tokens)}


def _probe(model, served, master, batch, temperature=1.0, seqs=4):
    probe = PolicyLagProbe(every=1, seqs=seqs)
    probe.measure(model, 0, *batch, served=served, master=master, temperature=temperature)
    return metrics_of(probe.take())


def test_metrics_equal_a_hand_computation_on_a_tiny_model():
    master_model, served_model = TinyLM(0), TinyLM(0)
    with torch.no_grad():  # a served copy that differs visibly: the master moved by some noise
        for p in master_model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    batch = _batch()
    want = _hand(served_model, master_model, batch[0], batch[2], batch[3], temperature=0.7)
    # the probe runs on one model: its parameters hold the master; the served view swaps in served_model's tensors
    served_of = {id(p): q.detach() for p, q in zip(master_model.parameters(), served_model.parameters())}
    got = _probe(master_model, lambda p: served_of[id(p)], lambda p: None, batch, temperature=0.7)
    assert set(got) == set(want)
    for k in want:  # the probe scores the sequences in one batched fp32 forward, the hand one at a time: the GEMMs'
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-12), k  # summation order differs in the last bits
    assert got[KL_KEY] > 0 and 0.25 <= got[ESS_KEY] < 1
    # the master's parameters are back after the probe (the swap is undone)
    for p, q in zip(master_model.parameters(), TinyLM(0).parameters()):
        assert not torch.equal(p, q)


def test_kl_zero_and_ess_one_when_the_served_copy_is_the_masters_bf16_view():
    model = _bf16(TinyLM(0))  # masters on the bf16 grid: round to nearest serves them exactly
    rtn = lambda p: served_weight(p.data, enabled=False, mode="stochastic", key=0)  # noqa: E731
    got = _probe(model, rtn, lambda p: None, _batch())
    assert got[KL_KEY] == 0.0 and got[ESS_KEY] == 1.0 and got[LOG_RATIO_STD_KEY] == 0.0


def test_flag_off_sub_half_ulp_updates_cost_kl_and_ess():
    """The standard export's lag: the master takes updates below half a bf16 step for several steps; round to nearest
    serves none of them, so the served policy differs from the master's (KL > 0, ESS/n < 1)."""
    model = _bf16(TinyLM(0))
    rtn = lambda p: served_weight(p.data, enabled=False, mode="nearest", key=0)  # noqa: E731
    g = torch.Generator().manual_seed(5)
    directions = [torch.sign(torch.randn(p.shape, generator=g)) for p in model.parameters()]
    seen = []
    for step in range(4):
        with torch.no_grad():
            for p, d in zip(model.parameters(), directions):
                ulp = (p.abs().clamp(min=1e-3).log2().floor() - 7).exp2()  # one bf16 step at p
                p.add_(0.12 * ulp * d)  # 0.12 ulp per step: 0.48 after 4, never a rounding boundary
        served_changed = any(not torch.equal(rtn(p), q) for p, q in zip(model.parameters(), _bf16(TinyLM(0)).parameters()))
        assert not served_changed  # the served copy never moved
        seen.append(_probe(model, rtn, lambda p: None, _batch()))
    assert all(m[KL_KEY] > 0 and m[ESS_KEY] < 1 for m in seen)
    assert seen[-1][KL_KEY] > seen[0][KL_KEY]  # the lag grows, and with it the KL


def test_fair_cast_view_matches_the_export_cast():
    from faircast_plugins import fair_cast

    x = torch.randn(1000) * 3
    for mode in ("stochastic", "sticky"):
        want = fair_cast(x, key=77, mode=mode, backend="torch").float()
        assert torch.equal(served_weight(x, enabled=True, mode=mode, key=77, backend="torch"), want)
    assert torch.equal(served_weight(x, enabled=True, mode="nearest", key=1), x.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="per-element state"):
        served_weight(x, enabled=True, mode="error_feedback", key=1)


def test_weights_swapped_keeps_one_module_swapped_at_a_time_and_restores():
    model = TinyLM(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    live, most = set(), [0]

    def view(p):
        live.add(id(p))
        most[0] = max(most[0], len(live))
        return torch.zeros_like(p)

    def release(module, args, out):
        live.clear()

    handles = [m.register_forward_hook(release) for m in model.modules() if list(m.parameters(recurse=False))]
    with weights_swapped(model, view):
        out = model(torch.tensor([[1, 2, 3]])).logits
    for h in handles:
        h.remove()
    assert torch.count_nonzero(out) == 0  # every module ran on the view (the tied head included)
    assert most[0] <= 2  # one module's parameters (mix: weight + bias) at a time
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    with pytest.raises((RuntimeError, IndexError)):  # a forward that raises leaves nothing swapped
        with weights_swapped(model, lambda p: torch.zeros_like(p)):
            model(torch.tensor([[VOCAB + 5]]))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_summarize_and_stats_edge_cases():
    assert summarize(torch.zeros(0, 3)) == {}
    assert summarize(torch.tensor([[0.0, 0.0, 0.0]])) == {}  # no counted token
    one = summarize(torch.tensor([[0.2, 4.0, -1.0]]))
    assert one[ESS_KEY] == 1.0 and one[KL_KEY] == pytest.approx(0.05) and one[LOG_RATIO_STD_KEY] == 0.0
    lopsided = summarize(torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, -800.0]]))  # no overflow: weights shifted
    assert lopsided[ESS_KEY] == pytest.approx(0.5)
    rows = torch.tensor([[0.1, 2.0, 0.0], [float("nan"), 2.0, 0.0]])
    m = metrics_of(rows)
    assert m["faircast/policy_nonfinite_seqs"] == 1.0 and m[SEQS_KEY] == 1.0
    with pytest.raises(ValueError, match="do not match"):
        sequence_stats(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4), torch.zeros(1, 2), torch.ones(1, 2))


def test_probe_is_due_once_per_multiple_of_every():
    probe = PolicyLagProbe(every=10, seqs=2)
    assert probe.due(0) and not probe.due(3) and probe.due(10)
    probe.measured_step = 10
    assert not probe.due(10)  # a second micro-batch of the same step
    with pytest.raises(ValueError):
        PolicyLagProbe(every=0)


def test_config_options():
    cfg = FairCastConfig.from_value({"enable": False, "policy_metrics_every": "10"})
    assert cfg.policy_metrics_every == 10 and cfg.policy_metrics_seqs == 2 and cfg.measures_policy and cfg.active
    assert not FairCastConfig().measures_policy and not FairCastConfig().active
    for bad in (-1, True, "x", 1.5):
        with pytest.raises(ValueError, match="policy_metrics_every"):
            FairCastConfig(policy_metrics_every=bad)
    with pytest.raises(ValueError, match="policy_metrics_seqs"):
        FairCastConfig(policy_metrics_seqs=0)
    assert "policy metrics every 10 steps" in cfg.describe()


def test_stacks_without_the_metric_refuse_it_at_activation():
    from faircast_plugins.caster import FairCaster
    from faircast_plugins.deepspeed.patch import apply_deepspeed_patch
    from faircast_plugins.fsdp import register_fsdp_module
    from faircast_plugins.patching import FairCastPatchError
    from faircast_plugins.verl.config import read_faircast

    caster = FairCaster(FairCastConfig(policy_metrics_every=10))  # no adapter set caster.policy_measured
    with pytest.raises(FairCastPatchError, match="apply_deepspeed_patch.*measure_policy=True.*remove the option"):
        apply_deepspeed_patch(object(), caster)
    with pytest.raises(FairCastPatchError, match="register_fsdp_module"):
        register_fsdp_module(torch.nn.Linear(2, 2), caster)
    # verl measures it on its FSDP engines (verl/policy.py) and its Megatron engine (verl/megatron.py)
    assert read_faircast({"faircast": {"enable": True, "policy_metrics_every": 10}}).policy_metrics_every == 10
    assert read_faircast({"faircast": {"enable": True}}).policy_metrics_every == 0


def test_chunks_under_the_logit_budget_give_the_same_metrics(monkeypatch):
    import faircast_plugins.policy_lag as pl

    master_model, served_model = TinyLM(0), TinyLM(1)
    served_of = {id(p): q.detach() for p, q in zip(master_model.parameters(), served_model.parameters())}
    whole = _probe(master_model, lambda p: served_of[id(p)], lambda p: None, _batch())
    monkeypatch.setattr(pl, "LOGIT_BUDGET", 1)  # one sequence per forward
    monkeypatch.setattr(pl, "POSITION_CHUNK", 3)  # and a few positions of float64 scratch at a time
    chunked = _probe(master_model, lambda p: served_of[id(p)], lambda p: None, _batch())
    assert chunked == pytest.approx(whole, rel=1e-6)


def test_chunk_size_and_slices_in_one_process():
    """The chunking PolicyLagProbe and the Megatron probe share (policy_lag.chunk_size / chunk_slices): as many
    sequences per forward as the logit budget allows, and each forward's ``(i, j, counted)``; out of a process group
    a collective chunking is this rank's own (the two-rank agreement: the test below)."""
    from faircast_plugins.policy_lag import chunk_size, chunk_slices

    assert chunk_size(5, 10, None) == 5 and chunk_size(0, 10, None) == 1  # no vocabulary size: all at once
    assert chunk_size(5, 10, 100, budget=8 * 10 * 100 * 2) == 2  # both views' fp32 logits of 2 sequences
    assert chunk_size(5, 10, 100, budget=1) == 1 and chunk_size(5, 10, 100, budget=1 << 40) == 5
    assert chunk_slices(5, 2) == chunk_slices(5, 2, collective=True) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert chunk_slices(0, 1, collective=True) == []


def test_hooks_detached_takes_the_given_hooks_out_and_puts_them_back_in_order():
    """policy_lag.hooks_detached (FSDP2's and DeepSpeed ZeRO-3's gather hooks around the probe's own forwards): the
    given hooks do not run inside, the others do; on exit (also on an exception) they are back in their original order,
    a hook added inside is kept after them, and one removed inside stays removed."""
    from faircast_plugins.policy_lag import hooks_detached

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ran = []

    def hook(tag):
        return lambda module, *args: ran.append(tag)

    first = a.register_forward_pre_hook(hook("a-pre1"))
    kept = a.register_forward_pre_hook(hook("a-pre2"))
    third = a.register_forward_pre_hook(hook("a-pre3"))
    post = a.register_forward_hook(hook("a-post"))
    other = b.register_forward_pre_hook(hook("b-pre"))
    x = torch.zeros(1, 2)
    with hooks_detached([first, third, post, other]):
        a(x), b(x)
        assert ran == ["a-pre2"]
        added = a.register_forward_pre_hook(hook("a-pre-added"))
        added_post = a.register_forward_hook(hook("a-post-added"))
    assert list(a._forward_pre_hooks) == [first.id, kept.id, third.id, added.id]
    assert list(a._forward_hooks) == [post.id, added_post.id] and list(b._forward_pre_hooks) == [other.id]
    ran.clear()
    a(x), b(x)
    assert ran == ["a-pre1", "a-pre2", "a-pre3", "a-pre-added", "a-post", "a-post-added", "b-pre"]
    with pytest.raises(RuntimeError, match="inside"):
        with hooks_detached([first]):
            kept.remove()
            assert list(a._forward_pre_hooks) == [third.id, added.id]
            raise RuntimeError("inside")
    assert list(a._forward_pre_hooks) == [first.id, third.id, added.id]


# -- vocab-parallel (tensor-parallel logits) ------------------------------------------------------------------------
def _tp_case(seed=3, b=3, t=7, vocab=12, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    served = torch.randn(b, t, vocab, generator=g, dtype=torch.float64) * scale
    master = served + torch.randn(b, t, vocab, generator=g, dtype=torch.float64) * 0.3
    tokens = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 4:] = 0
    return served.float(), master.float(), tokens, mask


def test_vocab_parallel_stats_without_a_group_equal_sequence_stats():
    served, master, tokens, mask = _tp_case()
    from faircast_plugins.policy_lag import vocab_parallel_sequence_stats

    for temperature in (1.0, 0.7):
        want = sequence_stats(served, master, tokens, mask, temperature)
        got = vocab_parallel_sequence_stats(served, master, tokens, mask, temperature)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _vocab_parallel_rank(rank, world, port, out, splits):
    import torch.distributed as dist

    from faircast_plugins.policy_lag import vocab_parallel_sequence_stats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        served, master, tokens, mask = _tp_case()
        results = []
        for bounds in splits:  # (start, end) of each rank's slice
            lo, hi = bounds[rank]
            start = None if bounds == _even(world, served.shape[-1]) else lo  # the default: Megatron's even split
            results.append(vocab_parallel_sequence_stats(served[..., lo:hi], master[..., lo:hi], tokens, mask, 0.8,
                                                         group=dist.group.WORLD, vocab_start=start))
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _even(world, vocab):
    per = vocab // world
    return [(r * per, (r + 1) * per) for r in range(world)]


def test_vocab_parallel_stats_over_two_ranks_equal_the_unsharded_ones(tmp_path):
    """Two gloo ranks, each with half of the vocabulary (and an uneven split with explicit ``vocab_start``): every
    rank gets the rows the unsharded computation gives, the sampled tokens falling on either rank."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    splits = [_even(2, 12), [(0, 5), (5, 12)]]
    out = str(tmp_path / "rows")
    mp.spawn(_vocab_parallel_rank, args=(2, port, out, splits), nprocs=2, join=True)
    served, master, tokens, mask = _tp_case()
    want = sequence_stats(served, master, tokens, mask, 0.8)
    assert ((tokens < 6) & (mask > 0)).any() and ((tokens >= 6) & (mask > 0)).any()  # both ranks hold sampled tokens
    for rank in range(2):
        for got in torch.load(f"{out}.{rank}"):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rebind", [False, True])
def test_weights_swapped_also_swaps_a_shared_weight_around_the_module_that_reads_it(rebind):
    """A Megatron output layer tied to the embedding reads the embedding's weight, handed in by its parent."""

    class Head(torch.nn.Module):
        def forward(self, h, weight):
            return h @ weight.t()

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = Head()

        def forward(self, ids):
            return self.head(self.embed(ids), self.embed.weight)

    model = Tied()
    ids = torch.tensor([[1, 2, 4]])
    other = {id(model.embed.weight): model.embed.weight.detach() * 2}
    view = lambda p: other.get(id(p))  # noqa: E731
    with torch.no_grad():
        plain = model(ids)
        with weights_swapped(model, view, rebind=rebind):  # the head reads the weight unswapped: half swapped
            half = model(ids)
        with weights_swapped(model, view, shared={model.head: [model.embed.weight]}, rebind=rebind):
            full = model(ids)
    torch.testing.assert_close(half, plain * 2)
    torch.testing.assert_close(full, plain * 4)
    assert torch.equal(model.embed.weight.detach() * 2, other[id(model.embed.weight)])  # restored


def test_rebind_keeps_the_gradient_accumulator_hooks_a_dtype_changing_swap_drops():
    """Megatron's DDP reduces gradients from hooks on each param's gradient accumulator. A ``p.data`` swap to fp32 of
    a bf16 param makes torch drop that accumulator (and its hooks); ``rebind=True`` never touches the Parameter."""
    for rebind, survives in ((False, False), (True, True)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
        fired = []
        keep = []
        for p in model.parameters():
            acc = p.expand_as(p).grad_fn.next_functions[0][0]  # what Megatron's DDP hooks
            acc.register_hook(lambda *_: fired.append(1))
            keep.append(acc)
        view = lambda p: p.data.float() * 2  # noqa: E731
        x = torch.randn(3, 4)
        with torch.no_grad(), weights_swapped(model, view, rebind=rebind):
            out = model(x)
        assert out.dtype == torch.float32
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        model(x.to(torch.bfloat16)).sum().backward()
        assert bool(fired) == survives, (rebind, len(fired))


def _forwards_per_rank(rank, world, port, out_dir):
    """One rank of test_collective_probe_runs_as_many_forwards_on_every_rank (gloo)."""
    import os

    import torch.distributed as dist

    import faircast_plugins.policy_lag as pl

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pl.LOGIT_BUDGET = 1  # one sequence per forward: rank 0 (2 sequences) needs 2, rank 1 (4 sequences) 4
        model, other = TinyLM(0), TinyLM(1)
        served_of = {id(p): q.detach() for p, q in zip(model.parameters(), other.parameters())}
        forwards = []
        model.register_forward_pre_hook(lambda m, a: forwards.append(1))  # where ZeRO-3 would all-gather
        result = {}
        for collective in (False, True):
            forwards.clear()
            probe = PolicyLagProbe(every=1, seqs=4)
            probe.measure(model, 0, *_batch(seqs=2 + 2 * rank), served=lambda p: served_of[id(p)],
                          master=lambda p: None, collective=collective)
            result[collective] = (len(forwards), probe.take())
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_collective_probe_runs_as_many_forwards_on_every_rank(tmp_path):
    """The views of DeepSpeed (and ZeRO-3's hooks) are collectives: a rank whose sequences need fewer chunked forwards
    than another's must still run as many (else the ranks' all-reduces pair up across different parameters, or hang).
    With ``collective=True`` both ranks run the most any needs, and the extra forwards add no rows."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_forwards_per_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r[False][0] for r in ranks] == [4, 8]  # per-rank chunking: 2 views x 2 and 2 views x 4 forwards
    assert [r[True][0] for r in ranks] == [8, 8]
    for r, seqs in zip(ranks, (2, 4)):
        assert r[True][1].shape[0] == seqs and torch.equal(r[True][1], r[False][1])


@pytest.mark.parametrize("raises", [False, True], ids=["measured", "a view raises"])
def test_probe_runs_every_module_in_eval_and_gives_each_its_own_mode_back(raises):
    """L3: the forwards run with every module in eval mode (no dropout); after them each module is back in its own
    mode, not the root's: a submodule the user kept in eval (a frozen tower) stays in eval, also when a forward
    raises."""
    model = TinyLM(0)
    model.train()
    model.mix.eval()
    seen = []
    model.mix.register_forward_pre_hook(lambda m, args: seen.append([x.training for x in model.modules()]))

    def served(p):
        if raises:
            raise RuntimeError("a view that fails")
        return p.data.to(torch.bfloat16).float()
    probe = PolicyLagProbe(every=1, seqs=2)
    if raises:
        with pytest.raises(RuntimeError, match="a view that fails"):
            probe.measure(model, 0, *_batch(seqs=2), served=served, master=lambda p: None)
    else:
        probe.measure(model, 0, *_batch(seqs=2), served=served, master=lambda p: None)
        assert seen and not any(any(s) for s in seen)
    assert model.training and model.embed.training and model.head.training and not model.mix.training


def test_collective_device_is_cuda_when_the_default_group_has_no_cpu_backend(monkeypatch):
    """A default group of only ``cuda:nccl`` has no CPU backend: the collectives' tensors go to CUDA (before: the CPU,
    which no backend of the group serves); verl's ``cpu:gloo,cuda:nccl`` keeps them on the CPU."""
    import torch.distributed as dist

    import faircast_plugins.policy_lag as pl

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cuda, cpu = torch.device("cuda", 3), torch.device("cpu")
    for backend, want in [("nccl", cuda), ("cuda:nccl", cuda), ("cpu:gloo,cuda:nccl", cpu), ("cuda:nccl,cpu:gloo", cpu),
                          ("gloo", cpu), ("cpu:gloo", cpu)]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: dist.Backend(b))
        assert pl._collective_device() == want, backend


def test_probe_scores_tokens_and_masks_on_the_logits_device(monkeypatch):
    """The statistics get the tokens and masks on the device of the logits (a model whose compute device is not where
    the adapter put the batch: FSDP2 with CPU offload hands the forward to CUDA): moved before ``sequence_stats``."""
    import faircast_plugins.policy_lag as pl

    class Elsewhere(torch.nn.Module):  # logits on another device than the batch ("meta" stands in for CUDA here)
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"vocab_size": VOCAB})()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, VOCAB, device="meta")})()

    seen = []

    def stats(s, m, tokens, mask, temperature):
        seen.append({s.device.type, m.device.type, tokens.device.type, mask.device.type})
        return torch.zeros(tokens.shape[0], 3, dtype=torch.float64)
    monkeypatch.setattr(pl, "sequence_stats", stats)
    PolicyLagProbe(every=1, seqs=2).measure(Elsewhere(), 0, *_batch(seqs=2), served=lambda p: None,
                                            master=lambda p: None)
    assert seen == [{"meta"}]


@pytest.mark.parametrize("rebind", [False, True])
def test_a_view_that_raises_midway_through_a_module_leaves_its_parameters_as_they_were(rebind):
    """A view raising on a module's second parameter (e.g. out of memory): the first, already swapped, goes back."""
    model = TinyLM(0)
    before = {n: (p, p.data) for n, p in model.named_parameters()}
    calls = []

    def view(p):
        calls.append(p)
        if p is model.mix.bias:
            raise RuntimeError("a view that fails")
        return p.detach().to(torch.bfloat16).float()
    with pytest.raises(RuntimeError, match="a view that fails"):
        with weights_swapped(model, view, rebind=rebind):
            model(torch.zeros(1, 3, dtype=torch.long))
    assert any(p is model.mix.weight for p in calls)  # the weight was swapped before the bias failed
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.data.data_ptr() == before[n][1].data_ptr(), n


def test_fsdp_owned_views_that_raise_midway_leave_the_module_as_it_was():
    """The FSDP probe's per-attribute swap (fsdp_policy.owned_swapped: a Parameter's ``.data``, or FSDP1's plain
    tensor attribute) shares swap_hooks' put-back: a view raising on the second attribute leaves the first as it was."""
    from faircast_plugins.fsdp_policy import _View, owned_swapped

    model = TinyLM(0)
    weight = model.mix.weight.data
    plain = torch.zeros(2)
    model.mix.__dict__["plain"] = plain  # FSDP1's unsharded views are instance attributes

    def view(module, name, t):
        if name == "bias":
            raise RuntimeError("a view that fails")
        return t.detach().to(torch.bfloat16).float()
    with pytest.raises(RuntimeError, match="a view that fails"):
        with owned_swapped({id(model.mix): (model.mix, ["weight", "plain", "bias"])}, _View(view)):
            model(torch.zeros(1, 3, dtype=torch.long))
    assert model.mix.weight.data.data_ptr() == weight.data_ptr() and model.mix.__dict__["plain"] is plain
