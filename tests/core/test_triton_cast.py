"""The Triton kernel against the torch reference, bit for bit (ROUNDING.md).

On a CPU machine the kernel runs under the Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before triton is imported: the ``tests-core`` nox session sets it in the environment, and this module sets it when
triton has not been imported yet. In ``tests-core`` (where the variable comes from the environment) a missing triton
is an error; elsewhere the module is skipped with the reason.
"""
from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

_INTERPRET_FROM_ENV = os.environ.get("TRITON_INTERPRET") == "1"
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    from faircast_plugins.kernels import triton_cast as tc
except ImportError as exc:
    if _INTERPRET_FROM_ENV:  # the tests-core session installs triton: its absence is a failure there
        raise
    pytest.skip(f"triton is not installed ({exc})", allow_module_level=True)

import triton  # noqa: E402

from faircast_plugins.cast import CastItem, fair_cast, fair_cast_many  # noqa: E402
from faircast_plugins.key import derive_key  # noqa: E402
from faircast_plugins import golden, torch_ref  # noqa: E402

if tc.interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: the kernel cannot run",
                allow_module_level=True)

K = derive_key(1234, 7, "model.layers.0.self_attn.q_proj.weight")
OFFSETS = (0, 3, 13, 2**32 - 5, 2**40 + 1)


def _f32(bits) -> torch.Tensor:
    """fp32 tensor from a list of uint32 bit patterns."""
    return torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32).view(torch.float32).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a bf16 or fp32 tensor, for exact comparison (NaN payloads included)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).cpu()


def _ref(x, *, key=K, offset=0, mode="stochastic", residual=None):
    return fair_cast(x, key=key, offset=offset, mode=mode, residual=residual, backend="torch")


def _tri(x, *, key=K, offset=0, mode="stochastic", residual=None, rows=None):
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    res = None if residual is None else residual.view(-1)
    tc.cast_many([CastItem(out.view(-1), x.reshape(-1), key, offset, res)], mode, rows=rows)
    return out


SPECIALS = golden.SPECIALS


def test_philox_known_answers():
    """ROUNDING.md §3's Random123 vectors, through the kernel's own device Philox."""
    counters = torch.tensor([[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]],
                            dtype=torch.int64, device=DEVICE)
    expected = {
        0: [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        0xFFFFFFFFFFFFFFFF: [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        0x299F31D0A4093822: [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    }
    for row, (key, want) in enumerate(expected.items()):
        assert tc.philox4x32_10(counters, key)[row].tolist() == want, hex(key)
    # Negative control: 7 rounds is a different generator.
    assert tc.philox4x32_10(counters, 0, n_rounds=7)[0].tolist() != expected[0]


def test_philox_matches_torch_reference_on_random_counters():
    g = torch.Generator().manual_seed(5)
    counters = torch.randint(0, 2**32, (2000, 4), generator=g, dtype=torch.int64)
    for key in (0, 1, 2**32 + 7, 0x0123456789ABCDEF, 2**63 - 1):
        ref = torch.stack(torch_ref.philox4x32(*counters.unbind(1), key & 0xFFFFFFFF, key >> 32), dim=1)
        assert torch.equal(tc.philox4x32_10(counters.to(DEVICE), key).cpu(), ref), hex(key)


def test_golden_noise_words():
    """ROUNDING.md §5's noise under K, from the device Philox and the contract's lane rule."""
    def noise(indices):
        groups = torch.tensor([[i >> 3 & 0xFFFFFFFF, i >> 35, 0, 0] for i in indices], dtype=torch.int64, device=DEVICE)
        words = tc.philox4x32_10(groups, K).cpu().tolist()
        return [(w[(i & 7) >> 1] >> (16 * (i & 1))) & 0xFFFF for w, i in zip(words, indices)]

    assert noise(range(16)) == [0x7857, 0xBB8C, 0xB992, 0xEB88, 0x463A, 0x655A, 0x152A, 0x684B,
                                0x776A, 0x1513, 0x04ED, 0xF856, 0x3506, 0x3D4F, 0xAA2E, 0x820A]
    assert noise(range(2**32 + 5, 2**32 + 9)) == [0x7A85, 0x178B, 0x5C5C, 0xAB48]


GOLDEN_IN, GOLDEN_OUT = golden.STOCHASTIC_K_IN, golden.STOCHASTIC_K_OUT


@pytest.mark.parametrize("rows", [1, 2, 1024])
def test_golden_table(rows):
    out = _tri(_f32(GOLDEN_IN), rows=rows)
    assert [b & 0xFFFF for b in _bits(out).tolist()] == GOLDEN_OUT
    # Negative control: another key moves some of the inexact values.
    other = _tri(_f32(GOLDEN_IN), key=derive_key(1234, 8, "model.layers.0.self_attn.q_proj.weight"), rows=rows)
    assert [b & 0xFFFF for b in _bits(other).tolist()] != GOLDEN_OUT


def test_sticky_golden_table():
    key = golden.STICKY_KEY_S[2]
    x = _f32(GOLDEN_IN)
    assert [b & 0xFFFF for b in _bits(_tri(x, key=key, mode="sticky")).tolist()] == golden.STICKY_S_OUT
    parts = _tri(x[:5], key=key, mode="sticky", rows=1), _tri(x[5:], key=key, offset=5, mode="sticky", rows=1)
    assert [b & 0xFFFF for b in _bits(torch.cat(parts)).tolist()] == golden.STICKY_S_OUT


def test_error_feedback_golden_table_and_no_sign_flip_near_overflow():
    x = _f32([row[0] for row in golden.ERROR_FEEDBACK])
    r = _f32([row[1] for row in golden.ERROR_FEEDBACK])
    assert [b & 0xFFFF for b in _bits(_tri(x, mode="error_feedback", residual=r)).tolist()] == \
        [row[2] for row in golden.ERROR_FEEDBACK]
    assert [b & 0xFFFFFFFF for b in _bits(r).tolist()] == [row[3] for row in golden.ERROR_FEEDBACK]
    # finite masters at and near the overflow threshold, many versions: always the largest finite bf16 of their sign
    x = _f32([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF])
    r = torch.zeros_like(x)
    for _ in range(16):
        assert [b & 0xFFFF for b in _bits(_tri(x, mode="error_feedback", residual=r)).tolist()] == \
            [0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F]


def _specials() -> torch.Tensor:
    """The special patterns, 24 times each, shuffled, so that every value meets every lane and many noises."""
    x = _f32(SPECIALS * 24)
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return x[perm].contiguous()


@pytest.mark.parametrize("offset", [0, 3, 2**40 + 1])
def test_special_values_all_modes(offset):
    x = _specials()
    for mode in ("stochastic", "sticky", "nearest"):
        assert torch.equal(_bits(_tri(x, offset=offset, mode=mode)), _bits(_ref(x, offset=offset, mode=mode))), mode
    # nearest is what the stacks serve today: x.to(bf16) on every non-NaN value (CPU torch writes NaN as 0xFFFF).
    finite_or_inf = ~torch.isnan(x)
    assert torch.equal(_bits(_tri(x, mode="nearest")[finite_or_inf]), _bits(x[finite_or_inf].to(torch.bfloat16)))
    # error feedback with a zero and a non-zero residual: q and the updated residual both match.
    specials_r = _f32(SPECIALS * 24).flip(0).contiguous()  # non-finite residuals too: they count as 0
    for start in (torch.zeros_like(x), torch.linspace(-1e-2, 1e-2, x.numel(), device=DEVICE), specials_r):
        r_tri, r_ref = start.clone(), start.clone()
        q_tri = _tri(x, mode="error_feedback", residual=r_tri)
        q_ref = _ref(x, mode="error_feedback", residual=r_ref)
        assert torch.equal(_bits(q_tri), _bits(q_ref))
        assert torch.equal(_bits(r_tri), _bits(r_ref))
        assert bool((r_tri[~torch.isfinite(x)] == 0).all())  # a non-finite master resets the residual


def test_contract_invariants_on_specials():
    """Direct checks of §4 (not only agreement with the reference): NaN stays NaN, saturation, exact values kept."""
    x = _f32(SPECIALS)
    out = [b & 0xFFFF for b in _bits(_tri(x)).tolist()]
    for u, o in zip(SPECIALS, out):
        mag = u & 0x7FFFFFFF
        if mag > 0x7F800000:
            assert o == ((u >> 16) | 0x0040), hex(u)
        elif mag == 0x7F800000:
            assert o == u >> 16, hex(u)
        else:
            assert (o & 0x7FFF) in ((mag >> 16), min((mag >> 16) + 1, 0x7F7F)) and o >> 15 == u >> 31, hex(u)
            if mag & 0xFFFF == 0:
                assert o == u >> 16, hex(u)


@pytest.mark.parametrize("offset", OFFSETS)
def test_random_normals_at_offsets(offset):
    gen = torch.Generator().manual_seed(offset % 1000)
    n = 12_001
    x = torch.cat([torch.randn(n, generator=gen) * 3, torch.randn(n, generator=gen) * 1e-3,
                   torch.rand(n, generator=gen) * 1e38, torch.randn(n, generator=gen) * 1e-39]).to(DEVICE)
    sr = _tri(x, offset=offset)
    assert torch.equal(_bits(sr), _bits(_ref(x, offset=offset)))
    rn = _tri(x, offset=offset, mode="nearest")
    assert torch.equal(_bits(rn), _bits(x.to(torch.bfloat16)))
    # Negative controls: the comparison sees the offset, and stochastic differs from nearest on about a quarter.
    assert not torch.equal(_bits(sr), _bits(_ref(x, offset=offset + 1)))
    changed = (_bits(sr) != _bits(rn)).float().mean().item()
    assert 0.2 < changed < 0.3, changed  # P(differ) = E[min(f, 1 - f)] = 1/4


@pytest.mark.parametrize("offset", [0, 5])
def test_block_sizes_give_the_same_bits(offset):
    x = torch.randn(1001, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = _bits(_ref(x, offset=offset))
    for rows in (2, 8, 64, 4096):
        assert torch.equal(_bits(_tri(x, offset=offset, rows=rows)), ref), rows
    assert torch.equal(_bits(_tri(x[:203], offset=offset, rows=1)), ref[:203])  # 1 row per program: slow in the interpreter
    with pytest.raises(ValueError, match="power of two"):
        _tri(x, rows=3)


def test_shard_invariance():
    """A tensor split at odd points and cast in independent launches equals the whole."""
    x = torch.randn(20_011, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    base = 2**32 - 5
    whole = _bits(_tri(x, offset=base))
    cuts = [0, 1, 8, 15, 4999, 10006, x.numel()]
    parts = [_tri(x[a:b], offset=base + a) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat([_bits(p) for p in parts]), whole)
    assert torch.equal(whole, _bits(_ref(x, offset=base)))
    # Negative control: shards cast as if each started at the tensor's start do not reassemble the whole.
    wrong = [_tri(x[a:b], offset=base) for a, b in zip(cuts, cuts[1:])]
    assert not torch.equal(torch.cat([_bits(p) for p in wrong]), whole)


def _multi_items(mode):
    """Tensors of many sizes, keys and offsets, aligned and not (odd storage offsets make unaligned pointers)."""
    gen = torch.Generator().manual_seed(4)
    storage = torch.randn(40_000, generator=gen).to(DEVICE)
    views = [storage[0:8], storage[8:9], storage[16:23], storage[32:2080], storage[2081:2181],  # aligned / odd pointers
             storage[2184:9000], torch.randn(3, generator=gen).to(DEVICE), storage[9001:40_000]]
    offsets = [0, 16, 2**40 + 1, 8, 3, 2**32 - 8, 13, 7]
    items = []
    for i, (v, off) in enumerate(zip(views, offsets)):
        res = torch.randn(v.numel(), generator=gen).to(DEVICE) * 1e-3 if mode == "error_feedback" else None
        items.append(CastItem(torch.empty(v.numel(), dtype=torch.bfloat16, device=DEVICE), v, derive_key(9, 2, f"p{i}"),
                              off, res))
    return items


@pytest.mark.parametrize("mode", ["stochastic", "sticky", "nearest", "error_feedback"])
def test_multi_tensor_launch_equals_per_tensor(mode, monkeypatch):
    items = _multi_items(mode)
    aligned = {tc._table_row(i, mode == "error_feedback", i.x.device)[-1] for i in items}
    assert aligned == {0, 1}  # both kernel branches are exercised
    refs = []
    for it in items:
        res = None if it.residual is None else it.residual.clone()
        refs.append((_bits(_ref(it.x, key=it.key, offset=it.offset, mode=mode, residual=res)),
                     None if res is None else _bits(res)))
    launches = []
    kernel = tc._cast_many_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tc, "_cast_many_kernel", Counting())
    tc.cast_many(items, mode)
    assert len(launches) == 1
    for it, (q, r) in zip(items, refs):
        assert torch.equal(_bits(it.out), q)
        if r is not None:
            assert torch.equal(_bits(it.residual), r)


def test_many_tensors_binary_search():
    """37 tensors (the in-kernel search over the launch table takes 6 steps), sizes 1..37, odd offsets."""
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, generator=gen).to(DEVICE) for n in range(1, 38)]
    offsets = [int(v) for v in torch.randint(0, 2**40, (37,), generator=gen)]
    keys = [derive_key(3, 5, f"layer.{i}.weight") for i in range(37)]
    items = [CastItem(torch.empty_like(x, dtype=torch.bfloat16), x, k, o) for x, k, o in zip(xs, keys, offsets)]
    tc.cast_many(items, "stochastic")
    for it in items:
        assert torch.equal(_bits(it.out), _bits(_ref(it.x, key=it.key, offset=it.offset)))


def test_error_feedback_over_steps():
    """Five EF exports of a slowly moving master: identical q and residual at every step, and the residual works."""
    gen = torch.Generator().manual_seed(6)
    x = (1 + torch.randn(30_000, generator=gen) * 0.01).to(DEVICE)
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.4e38])
    r_tri, r_ref = torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(5):
        x = x + 1e-4
        q_tri = _tri(x, mode="error_feedback", residual=r_tri)
        q_ref = _ref(x, mode="error_feedback", residual=r_ref)
        assert torch.equal(_bits(q_tri), _bits(q_ref))
        assert torch.equal(_bits(r_tri), _bits(r_ref))
    assert r_tri[:3].tolist() == [0.0, 0.0, 0.0]
    assert bool((r_tri != 0).any())  # the residual carries state (a no-op EF would leave it at 0)


def test_public_api_backend_triton():
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(s, generator=gen).to(DEVICE) for s in [(64, 32), (5,), (3, 7, 11)]]
    keys = [derive_key(0, 1, f"w{i}") for i in range(3)]
    got = fair_cast_many(xs, keys=keys, offsets=[0, 3, 2**33], backend="triton")
    want = fair_cast_many(xs, keys=keys, offsets=[0, 3, 2**33], backend="torch")
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(_bits(g), _bits(w))
    one = fair_cast(xs[0], key=keys[0], backend="triton")
    assert torch.equal(_bits(one), _bits(want[0]))


def test_bad_input_is_refused():
    x = torch.randn(16, device=DEVICE)
    out = torch.empty(16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="unknown Fair Cast mode"):
        tc.cast_many([CastItem(out, x, 0)], "floor")
    with pytest.raises(TypeError, match="fp32"):
        tc.cast_many([CastItem(out, x.half(), 0)], "stochastic")
    with pytest.raises(ValueError, match="same number of elements"):
        tc.cast_many([CastItem(out[:8], x, 0)], "stochastic")
    with pytest.raises(ValueError, match="residual"):
        tc.cast_many([CastItem(out, x, 0)], "error_feedback")
    with pytest.raises(ValueError, match="key"):
        tc.cast_many([CastItem(out, x, -1)], "stochastic")
    with pytest.raises(ValueError, match="offset"):
        tc.cast_many([CastItem(out, x, 0, 2**63)], "stochastic")


def test_import_error_without_triton(monkeypatch):
    """Without triton the module raises a clear ImportError, and the package itself still imports."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "faircast_plugins.kernels.triton_cast")
    with pytest.raises(ImportError, match="pip install 'triton>=3.2'"):
        importlib.import_module("faircast_plugins.kernels.triton_cast")
    importlib.import_module("faircast_plugins")


def test_compiles_for_sm90_with_vectorized_fast_path():
    """The real (non-interpreted) compiler builds every mode for an H100/H200 (sm_90) without a GPU.

    The interpreter cannot catch codegen errors; this does, and it checks that the aligned branch gets 128-bit
    loads and stores. It runs in a subprocess because this process runs triton in interpreter mode.
    """
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip(f"triton {triton.__version__} has the older ASTSource API; this check is written for triton>=3.3")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from faircast_plugins.kernels import triton_cast as tc
        from benchmarks.triton_regs import MODES, compile_variant, resource_usage
        for mode in MODES:
            kernel = compile_variant(mode, tc.DEFAULT_ROWS, tc.DEFAULT_NUM_WARPS, 90)
            use = resource_usage(kernel.asm["cubin"])  # the default tile must not spill (stack/local memory)
            ptx = kernel.asm["ptx"]
            print(MODES[mode], ptx.count("ld.global.v4"), ptx.count("st.global.v4"), use["stack"] + use["local"])
        # The known-answer helper.
        sig = {"counters_ptr": "*i64", "key_ptr": "*i64", "out_ptr": "*i64", "n": "i32", "BLOCK": "constexpr",
               "N_ROUNDS": "constexpr"}
        src = ASTSource(fn=tc._philox_kernel, signature=sig, constexprs={"BLOCK": 1024, "N_ROUNDS": 10})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    assert sorted(int(line[0]) for line in lines[:3]) == [0, 1, 2]
    for _, loads, stores, spilled in lines[:3]:
        assert int(loads) > 0 and int(stores) > 0, proc.stdout
        assert int(spilled) == 0, f"the default tile spills: {proc.stdout}"
