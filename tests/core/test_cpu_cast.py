"""The numba ``cpu`` backend, bit for bit against ROUNDING.md and the torch reference.

numba is installed in tests-core, so this module imports the kernel unconditionally: a missing or broken numba
is a collection error here, never a silent skip. Nothing is timed.
"""
import os
import subprocess
import sys

import pytest
import torch

from faircast_plugins import derive_key, fair_cast, fair_cast_many, golden
from faircast_plugins.cast import CastItem, resolve_backend
from faircast_plugins.kernels import cpu_cast

K = golden.KEY_K[3]
KEYS = [0, K, derive_key(7, 0, "lm_head.weight"), 2**63 - 1, 2**64 - 1]
# offsets: aligned, unaligned heads, the 2**31 / 2**32 element and group boundaries, far beyond 2**32
OFFSETS = [0, 1, 5, 7, 8, 13, 2**31 - 3, 2**32 - 5, 2**32 + 3, 8 * 2**32 - 21, 2**40 + 1, 2**62 + 5]
BLOCK = 8 * cpu_cast.BLOCK_GROUPS  # elements per parallel block of the kernel
PARALLEL_NUMEL = cpu_cast.PARALLEL_MIN_NUMEL  # read before kernel_path patches it


@pytest.fixture(autouse=True, params=["serial", "parallel", "streaming"])
def kernel_path(request, monkeypatch):
    """Run every test through each kernel: the calling-thread one (small tensors), the multithreaded one, and the
    multithreaded one with non-temporal stores of the stochastic output (large tensors)."""
    monkeypatch.setattr(cpu_cast, "PARALLEL_MIN_NUMEL", 2**62 if request.param == "serial" else 0)
    monkeypatch.setattr(cpu_cast, "STREAM_MIN_NUMEL", 0 if request.param == "streaming" else 2**62)
    return request.param


def bits(t):
    return t.reshape(-1).view(torch.int16)


def cpu(x, key=K, offset=0, mode="stochastic", residual=None, **kw):
    return fair_cast(x, key=key, offset=offset, mode=mode, residual=residual, backend="cpu", **kw)


def ref(x, key=K, offset=0, mode="stochastic", residual=None):
    return fair_cast(x, key=key, offset=offset, mode=mode, residual=residual, backend="torch")


def from_bits(values):
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def assert_same(a, b):
    diff = (bits(a) != bits(b)).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} of {a.numel()} differ, first at {diff[:5].tolist()}"


SPECIALS = golden.SPECIALS


def mixed(n, seed=0):
    """Normals at several scales, subnormals, uniform random bit patterns (NaNs included) and the specials."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=g) * s for s in (1.0, 1e-3, 3e4, 1e-39, 1e38)]
    parts.append(torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32))
    parts.append(from_bits(SPECIALS * (n // len(SPECIALS) + 1))[:n])
    x = torch.stack(parts, dim=1).reshape(-1)  # interleaved, so specials land in every block
    return x[torch.randperm(x.numel(), generator=g)]


# ---------------------------------------------------------------------------------------------- availability


def test_auto_picks_the_numba_kernel_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"


def test_each_path_runs_its_own_kernel(kernel_path, monkeypatch):
    ran = []
    for mode, pair in list(cpu_cast._KERNELS.items()):
        spies = tuple((lambda k, name: (lambda *a: (ran.append(name), k(*a))))(k, f"{mode}/{i}") for i, k in enumerate(pair))
        monkeypatch.setitem(cpu_cast._KERNELS, mode, spies)
    x = torch.randn(100)
    cpu(x)
    cpu(x, mode="nearest")
    cpu(x, mode="error_feedback", residual=torch.zeros(100))
    i = 0 if kernel_path == "serial" else 1
    assert ran == [f"stochastic/{i}", f"nearest/{i}", f"error_feedback/{i}"]


def test_only_large_tensors_stream_their_output(kernel_path, monkeypatch):
    flags = []
    serial, parallel = cpu_cast._KERNELS["stochastic"]
    monkeypatch.setitem(cpu_cast._KERNELS, "stochastic", tuple(
        (lambda k: (lambda *a: (flags.append(a[-1]), k(*a))))(k) for k in (serial, parallel)))
    monkeypatch.setattr(cpu_cast, "STREAM_MIN_NUMEL", 1000)
    x = mixed(200, seed=4)
    small, large = cpu(x[:999]), cpu(x[:1000], offset=3)
    assert flags == [False, True]
    assert_same(small, ref(x[:999]))
    assert_same(large, ref(x[:1000], offset=3))


def test_kernels_are_disk_cached_and_not_fastmath():
    for kernel in (k for pair in cpu_cast._KERNELS.values() for k in pair):
        assert kernel.targetoptions.get("cache") is not False
        assert type(kernel._cache).__name__ != "NullCache", "cache=True was dropped"
        assert not kernel.targetoptions.get("fastmath"), "fastmath would break EF bit-identity"


def test_missing_numba_is_a_clean_import_error_and_torch_takes_over(kernel_path):
    if kernel_path != "serial":
        pytest.skip("runs in a fresh process, the same under every kernel path: once is enough")
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import faircast_plugins, torch\n"
        "from faircast_plugins.cast import available_backends, resolve_backend\n"
        "try:\n"
        "    from faircast_plugins.kernels import cpu_cast\n"
        "except ImportError as e:\n"
        "    assert 'pip install' in str(e) and 'numba' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('imported without numba')\n"
        "assert 'cpu' not in available_backends()\n"
        "assert resolve_backend('auto', torch.device('cpu')) == 'torch'\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


# Run in a fresh process: numba starts its thread pool once per process, on the first cast.
THREADS_PROBE = """
import sys, torch, numba
from faircast_plugins.kernels import cpu_cast
torch.set_num_threads(1)
assert torch.get_num_threads() == 1  # also torch's lazy per-thread init, done by any parallel op before a cast
if sys.argv[1] == "unguarded":
    numba.set_num_threads(1)  # what the kernel calls to pick its thread count, without the guard around it
else:
    from faircast_plugins import fair_cast
    fair_cast(torch.ones(int(sys.argv[1])), key=1, backend="cpu")
print(numba.threading_layer(), torch.get_num_threads())
"""


def _threads_after(arg: str) -> tuple:
    env = {**os.environ, "NUMBA_THREADING_LAYER": "omp", "NUMBA_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", THREADS_PROBE, arg], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode and "No threading layer could be loaded" in run.stderr:
        pytest.skip(f"numba's OpenMP threading layer does not load here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    layer, threads = run.stdout.split()
    return layer, int(threads)


def test_first_cast_keeps_the_torch_thread_count(kernel_path):
    """The first cast of a process starts numba's thread pool; its OpenMP layer then sets the OpenMP thread count,
    which it shares with torch, to NUMBA_NUM_THREADS (omp_set_num_threads). A caller's torch.set_num_threads(1)
    silently became the CPU count, and every torch op after the first cast ran with other threads (different
    reduction orders: DeepSpeed's bf16 LayerNorm gradients changed in the last bits, tests/openrlhf). The cast must
    leave torch's thread count as the caller set it. Negative control: the pool's start without the guard changes it."""
    if kernel_path == "streaming":
        pytest.skip("runs in a fresh process, where the size alone picks the kernel: the serial run covers this one")
    layer, threads = _threads_after(str(PARALLEL_NUMEL if kernel_path == "parallel" else 100))
    assert (layer, threads) == ("omp", 1), f"after the first cast, torch.get_num_threads() is {threads} (layer {layer})"
    if kernel_path == "serial":
        assert _threads_after("unguarded") == ("omp", 2), "the control no longer shows numba changing torch's threads"


# ---------------------------------------------------------------------------------------------- the contract


def test_golden_table():
    x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN)
    assert golden.bf16_bits(cpu(x)) == golden.STOCHASTIC_K_OUT
    assert golden.bf16_bits(cpu(x.view(4, 4))) == golden.STOCHASTIC_K_OUT
    # negative control: another key or a shifted offset does not reproduce the table
    assert golden.bf16_bits(cpu(x, key=K ^ 1)) != golden.STOCHASTIC_K_OUT
    assert golden.bf16_bits(cpu(x, offset=8)) != golden.STOCHASTIC_K_OUT


@pytest.mark.parametrize("cut", [0, 5, 13])
def test_sticky_golden_table(cut):
    x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN)
    key = golden.STICKY_KEY_S[2]
    parts = cpu(x[:cut], key=key, mode="sticky"), cpu(x[cut:], key=key, offset=cut, mode="sticky")
    assert golden.bf16_bits(torch.cat(parts)) == golden.STICKY_S_OUT
    assert _noise_through_the_kernel(key, *golden.NOISE_S[1][:1], 4) == golden.NOISE_S[1][1]


def test_error_feedback_golden_table():
    x = from_bits([row[0] for row in golden.ERROR_FEEDBACK])
    r = from_bits([row[1] for row in golden.ERROR_FEEDBACK])
    assert golden.bf16_bits(cpu(x, mode="error_feedback", residual=r)) == [row[2] for row in golden.ERROR_FEEDBACK]
    assert [v & 0xFFFFFFFF for v in r.view(torch.int32).tolist()] == [row[3] for row in golden.ERROR_FEEDBACK]


@pytest.mark.parametrize("cut", [1, 5, 8, 13])
def test_golden_table_as_two_shards(cut):
    x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN)
    parts = cpu(x[:cut]), cpu(x[cut:], offset=cut)
    assert golden.bf16_bits(torch.cat(parts)) == golden.STOCHASTIC_K_OUT


def _noise_through_the_kernel(key, start, n):
    """Recover each element's 16-bit noise from the cast alone: 1 + f*2**-23 rounds up iff f >= 65536 - noise."""
    lo = torch.zeros(n, dtype=torch.int64)  # smallest f known to round up lies in (lo, hi]
    hi = torch.full((n,), 65536, dtype=torch.int64)
    lo -= 1
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        x = from_bits((0x3F800000 + mid.clamp(0, 65535)).tolist())
        up = bits(cpu(x, key=key, offset=start)).to(torch.int64) == 0x3F81
        up &= mid <= 65535
        hi = torch.where(up, mid, hi)
        lo = torch.where(up, lo, mid)
    return (65536 - hi).tolist()


@pytest.mark.parametrize("start,want", golden.NOISE_K)
def test_golden_noise(start, want):
    assert _noise_through_the_kernel(K, start, len(want)) == want


def test_philox_known_answer_key_zero():
    # Random123 / tl.randint4x(0, 0) = 6627e8d5 e169c58d bc57ac4c 9b00dbd8, read as 8 16-bit lanes
    assert _noise_through_the_kernel(0, 0, 8) == [0xE8D5, 0x6627, 0xC58D, 0xE169, 0xAC4C, 0xBC57, 0xDBD8, 0x9B00]


def test_specials_table():
    x = from_bits(SPECIALS)
    want = {0x00000000: 0x0000, 0x80000000: 0x8000, 0x7F800000: 0x7F80, 0xFF800000: 0xFF80, 0x7F800001: 0x7FC0,
            0xFF800001: 0xFFC0, 0xFFFFFFFF: 0xFFFF, 0x7F7FFFFF: 0x7F7F, 0xFF7FFFFF: 0xFF7F, 0x7F7F0001: 0x7F7F,
            0x7FBFFFFF: 0x7FFF, 0x3F800000: 0x3F80}
    for key in KEYS:
        for offset in (0, 3, 2**32 + 1):
            out = golden.bf16_bits(cpu(x, key=key, offset=offset))
            for i, u in enumerate(SPECIALS):
                if u in want:
                    assert out[i] == want[u], (hex(u), hex(out[i]), key, offset)
            assert_same(cpu(x, key=key, offset=offset), ref(x, key=key, offset=offset))


def test_every_bf16_exact_value_is_unchanged():
    hi = torch.arange(65536, dtype=torch.int64)
    x = from_bits((hi << 16).tolist())
    nan = ((hi & 0x7FFF) > 0x7F80)
    want = torch.where(nan, hi | 0x0040, hi).to(torch.int16)
    for key in (0, K, 2**63 - 1):
        for offset in (0, 5, 2**32 + 3):
            assert torch.equal(bits(cpu(x, key=key, offset=offset)), want)


@pytest.mark.parametrize("offset", OFFSETS)
def test_mixed_values_match_reference(offset):
    x = mixed(1500, seed=offset % 1000)
    for key in (K, 2**64 - 1):
        got = cpu(x, key=key, offset=offset)
        assert_same(got, ref(x, key=key, offset=offset))
        # negative control: the comparison sees an off-by-one global index
        assert (bits(got) != bits(ref(x, key=key, offset=offset + 1))).float().mean() > 0.1


def test_sampled_bit_patterns_match_reference():
    x = from_bits(list(range(0, 2**32, 65521)))  # 65,551 patterns over the whole 32-bit space
    for key, offset in ((K, 0), (0, 2**32 + 7)):
        assert_same(cpu(x, key=key, offset=offset), ref(x, key=key, offset=offset))


@pytest.mark.parametrize("n", list(range(1, 18)) + [BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
@pytest.mark.parametrize("offset", [0, 3, 7, BLOCK - 3, 2**32 - 1])
def test_head_tail_and_block_edges(n, offset):
    x = mixed(n // 7 + 1, seed=n)[:n]
    assert_same(cpu(x, offset=offset), ref(x, offset=offset))


def test_block_across_the_2_32_group_boundary():
    # group index 2**32 starts at element 8 * 2**32: blocks around it must carry the counter's high word
    n = 5 * BLOCK + 77
    x = mixed(n // 7 + 1, seed=3)[:n]
    for offset in (8 * 2**32 - 2 * BLOCK - 5, 8 * 2**32 - 1, 8 * 2**32):
        assert_same(cpu(x, offset=offset), ref(x, offset=offset))


@pytest.mark.parametrize("n", [1, 8, 100, BLOCK + 3])
def test_last_indices_below_2_63(n):
    x = mixed(n // 7 + 1, seed=n)[:n]
    offset = 2**63 - n  # the largest global index the API accepts is 2**63 - 1
    assert_same(cpu(x, offset=offset), ref(x, offset=offset))


def test_fast_and_full_paths_agree_per_block():
    # ordinary weights take the add-and-shift path; one NaN or near-max value sends only its block down the full path
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6 * BLOCK, generator=g)
    x[BLOCK + 17] = float("nan")
    x[3 * BLOCK + 1] = 3.3e38
    x[5 * BLOCK - 1] = from_bits([0xFF7F0001])[0]  # just past the fast path's limit, negative, finite
    for offset in (0, 11):
        assert_same(cpu(x, offset=offset), ref(x, offset=offset))


def test_one_special_sends_only_its_chunk_down_the_full_path():
    # the rounding pass takes the vector add-and-shift per chunk of CHUNK elements unless one element is near bf16
    # max, inf or NaN: put such a value at every lane of a chunk in turn, next to chunks of ordinary weights
    chunk = cpu_cast.CHUNK
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3 * chunk * chunk + 5, generator=g) * 0.02
    # (u + noise) >> 16 would serve these as +inf, +inf and -inf (0x7F80/0x7F81, 0xFF80/0xFF81); the contract serves
    # a quiet NaN, the largest finite bf16 and a quiet negative NaN
    specials, served = [0x7F800001, 0x7F7FFFFF, 0xFF800001], [0x7FC0, 0x7F7F, 0xFFC0 - 0x10000]
    where = [3 * chunk * lane + lane for lane in range(chunk)]
    for k, i in enumerate(where):
        x[i] = from_bits([specials[k % 3]])[0]
    for offset in (0, 3, 2**32 - 1):
        got = cpu(x, offset=offset)
        assert_same(got, ref(x, offset=offset))
        assert bits(got)[where].tolist() == [served[k % 3] for k in range(chunk)]


@pytest.mark.parametrize("cuts", [(1,), (7,), (8,), (4999,), (1, 2048, 2049, 10006)])
def test_shard_invariance(cuts):
    x = mixed(2000, seed=9)[:12000]
    base = 2**32 - 6001
    whole = cpu(x, offset=base)
    bounds = [0, *cuts, x.numel()]
    parts = [cpu(x[a:b].clone(), offset=base + a) for a, b in zip(bounds, bounds[1:])]
    assert_same(torch.cat(parts), whole)
    assert_same(whole, ref(x, offset=base))


def test_thread_count_does_not_change_bits():
    x = mixed(40000, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu(x, offset=5)
    finally:
        torch.set_num_threads(before)
    assert_same(one, cpu(x, offset=5))


def test_stochastic_is_not_nearest():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(4))
    sr, rn = cpu(x), cpu(x, mode="nearest")
    changed = (bits(sr) != bits(rn)).float().mean()
    assert 0.2 < changed < 0.3  # E[min(frac, 1 - frac)] = 1/4 of the values round the other way


# ---------------------------------------------------------------------------------------------- nearest, EF


def test_nearest_matches_reference_and_plain_cast():
    x = torch.cat([mixed(3000, seed=6), from_bits(list(range(0x7F7F7FF0, 0x7F7F8010)) + [0x3F808000, 0x3F818000])])
    assert_same(cpu(x, mode="nearest"), ref(x, mode="nearest"))
    finite = x[torch.isfinite(x)]
    assert_same(cpu(finite, mode="nearest"), finite.to(torch.bfloat16))  # incl. ties to even and overflow to inf
    assert golden.bf16_bits(cpu(from_bits([0x7F800001, 0xFFFFFFFF]), mode="nearest")) == [0x7FC0, 0xFFFF]


def test_error_feedback_matches_reference_over_steps():
    g = torch.Generator().manual_seed(8)
    x = mixed(2000, seed=8)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    r_cpu = torch.randn(x.shape, generator=g) * 1e-4
    r_cpu[:50] = float("inf")  # a non-finite residual counts as 0
    r_cpu[50:60] = float("nan")
    x[60:70] = 3.4e38  # near overflow: saturated, residual reset
    r_ref = r_cpu.clone()
    for step in range(4):
        x = x + torch.randn(x.shape, generator=g) * 1e-5
        q_cpu = cpu(x, mode="error_feedback", residual=r_cpu)
        q_ref = ref(x, mode="error_feedback", residual=r_ref)
        assert_same(q_cpu, q_ref)
        assert torch.equal(r_cpu.view(torch.int32), r_ref.view(torch.int32)), f"residual differs at step {step}"
        if step == 0:
            fresh = torch.zeros(60)
            ref(x[:60].clone(), mode="error_feedback", residual=fresh)
            assert torch.equal(r_cpu[:60], fresh) and bool(r_cpu[70:].ne(0).any())
        assert golden.bf16_bits(q_cpu[60:70]) == [0x7F7F] * 10


def test_error_feedback_is_exact_and_keeps_subnormals():
    x = from_bits([0x00000003, 0x80000005, 0x00800001, 0x3F808001, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x00000000])
    r = from_bits([0x00000001, 0x00000001, 0x80000002, 0x00000000, 0x7F000000, 0x3F800000, 0x00000000, 0x80000000])
    s = x + r
    q = cpu(x, mode="error_feedback", residual=r)
    finite = torch.isfinite(s)
    assert torch.equal((q.float() + r)[finite], s[finite])  # q + r' == x + r exactly where s is finite
    assert bool((r[~finite] == 0).all())
    assert r[0].item() != 0.0  # a subnormal residual survives (no flush-to-zero)
    assert golden.bf16_bits(q)[6] == 0x7FC0


def test_error_feedback_chunks_and_their_edges():
    # error feedback runs a vector chunk of CHUNK elements when every sum is finite and below the overflow threshold;
    # one special input or a sum at the threshold sends only its chunk to the per-element rule. Put one at every lane
    # in turn among ordinary weights, with sums on both sides of the threshold, ties and subnormals in fast chunks,
    # and run on views that start off the vector grid.
    chunk = cpu_cast.CHUNK
    g = torch.Generator().manual_seed(11)
    n = 3 * chunk * chunk + 7
    x = torch.randn(n + 1, generator=g) * 0.02
    r = torch.randn(n + 1, generator=g) * 1e-5
    specials = [  # (x bits, r bits): a NaN x, an inf r, a NaN r, a sum at the threshold, a sum rounding to -inf
        (0x7FC00001, 0x00000000), (0x3C000000, 0x7F800000), (0x3C000000, 0xFFC00000),
        (0x7F7F8000, 0x00000000), (0xFF7F7000, 0xF3800000)]
    for lane in range(chunk):
        xb, rb = specials[lane % len(specials)]
        x[3 * chunk * lane + lane], r[3 * chunk * lane + lane] = from_bits([xb])[0], from_bits([rb])[0]
    edges = [  # fast-path values: just below the threshold, ties both ways, subnormal sums, a zero sum
        (0x7F7F7FFF, 0x00000000), (0x3F808000, 0x00000000), (0x3F818000, 0x00000000), (0x00000003, 0x80000001),
        (0x80000005, 0x00000001), (0x3C23D70A, 0xBC23D70A), (0x80000000, 0x00000000)]
    for k, (xb, rb) in enumerate(edges):
        x[2 * chunk + k], r[2 * chunk + k] = from_bits([xb])[0], from_bits([rb])[0]
    for start in (0, 1):
        xs, r_cpu = x.clone()[start:start + n], r.clone()[start:start + n]  # start 1: views off the vector grid
        r_ref = r_cpu.clone()
        for step in range(2):
            q_cpu = cpu(xs, mode="error_feedback", residual=r_cpu)
            assert_same(q_cpu, ref(xs, mode="error_feedback", residual=r_ref))
            assert torch.equal(r_cpu.view(torch.int32), r_ref.view(torch.int32)), f"residual differs at step {step}"
            xs = xs + 1e-6
    q = cpu(from_bits([0x7F7F7FFF, 0x7F7F8000] + [0] * (chunk - 2)), mode="error_feedback",
            residual=torch.zeros(chunk))
    assert golden.bf16_bits(q)[:2] == [0x7F7F, 0x7F7F]  # below the threshold: nearest; at it: saturated


# ---------------------------------------------------------------------------------------------- batches, views


def test_fair_cast_many_matches_per_item_reference():
    g = torch.Generator().manual_seed(10)
    xs = [mixed(n // 7 + 1, seed=n)[:n] for n in (1, 9, 2048, 5000, 33333)]
    keys = [derive_key(1, 2, f"p{i}") for i in range(len(xs))]
    offs = [0, 3, 2**32 + 5, 17, 2**40 + 1]
    for mode in ("stochastic", "sticky"):
        for got, x, key, off in zip(fair_cast_many(xs, keys=keys, offsets=offs, mode=mode, backend="cpu"), xs, keys, offs):
            assert_same(got, ref(x, key=key, offset=off, mode=mode))
    rs = [torch.randn(x.shape, generator=g) * 1e-3 for x in xs]
    rs_ref = [r.clone() for r in rs]
    xs = [torch.where(torch.isfinite(x), x, torch.ones_like(x)) for x in xs]
    got = fair_cast_many(xs, keys=keys, mode="error_feedback", residuals=rs, backend="cpu")
    want = fair_cast_many(xs, keys=keys, mode="error_feedback", residuals=rs_ref, backend="torch")
    for a, b, r, rr in zip(got, want, rs, rs_ref):
        assert_same(a, b)
        assert torch.equal(r, rr)


def test_cast_many_writes_in_place_through_views():
    big = torch.randn(10000)
    x = big[37:9037]  # contiguous view at a storage offset
    out_store = torch.zeros(9100, dtype=torch.bfloat16)
    out = out_store[50:9050]
    cpu_cast.cast_many([CastItem(out, x, K, 2**32 + 1)], "stochastic")
    assert_same(out, ref(x.clone(), offset=2**32 + 1))
    assert bool((bits(out_store[:50]) == 0).all()) and bool((bits(out_store[9050:]) == 0).all())


def test_parameter_with_grad_and_preallocated_out():
    p = torch.nn.Parameter(torch.randn(64, 33))
    out = torch.empty(64, 33, dtype=torch.bfloat16)
    got = cpu(p, out=out, offset=9)
    assert got.data_ptr() == out.data_ptr()
    assert_same(out, ref(p.detach(), offset=9))


def test_cast_many_rejects_bad_items():
    x = torch.randn(16)
    with pytest.raises(ValueError, match="flat contiguous"):
        cpu_cast.cast_many([CastItem(torch.empty(4, 4, dtype=torch.bfloat16), x.view(4, 4), 0)], "stochastic")
    with pytest.raises(TypeError, match="fp32 x into a bf16 out"):
        cpu_cast.cast_many([CastItem(torch.empty(16, dtype=torch.float16), x, 0)], "stochastic")
    with pytest.raises(ValueError, match="needs an fp32 residual"):
        cpu_cast.cast_many([CastItem(torch.empty(16, dtype=torch.bfloat16), x, 0)], "error_feedback")
    with pytest.raises(ValueError, match="unknown Fair Cast mode"):
        cpu_cast.cast_many([CastItem(torch.empty(16, dtype=torch.bfloat16), x, 0)], "dither")



def test_the_cpu_kernel_leaves_the_tensors_storage_resizable():
    """verl's param_offload frees Megatron's bucket storage (resize_(0)) and restores it between steps: a cast into it
    must not mark it non-resizable (Tensor.numpy() does, for good)."""
    from faircast_plugins.cast import fair_cast

    x = torch.randn(4096)
    out = torch.empty(4096, dtype=torch.bfloat16)
    fair_cast(x, key=7, out=out, backend="cpu")
    assert out.untyped_storage().resizable() and x.untyped_storage().resizable()
    out.untyped_storage().resize_(0)
    out.untyped_storage().resize_(4096 * 2)
