"""The known answers of ROUNDING.md section 5, as data: shared by ``faircast selftest`` and the tests."""
from __future__ import annotations

import torch

KEY_ZERO = (0, 0, "w", 0x69D3E695B1F2C727)
KEY_K = (1234, 7, "model.layers.0.self_attn.q_proj.weight", 0x24B966A3AF97FCBD)

# Philox4x32-10: (counter words, key words) -> output words
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# noise under K: (first global index, values)
NOISE_K = [
    (0, [0x7857, 0xBB8C, 0xB992, 0xEB88, 0x463A, 0x655A, 0x152A, 0x684B,
         0x776A, 0x1513, 0x04ED, 0xF856, 0x3506, 0x3D4F, 0xAA2E, 0x820A]),
    (2**32 + 5, [0x7A85, 0x178B, 0x5C5C, 0xAB48]),
]

# stochastic under K: element i (= position) holds these fp32 bits -> bf16 bits
STOCHASTIC_K_IN = [0x3F800000, 0x3F808000, 0x3F80FFFF, 0xBF80C000, 0x00000001, 0x80000000, 0x7F7FFFFF, 0x7F800000,
                   0xFF800000, 0x7F800001, 0xFFFFFFFF, 0x3F812345, 0x40490FDB, 0xC0490FDB, 0x3F7FFFFF, 0x00800000]
STOCHASTIC_K_OUT = [0x3F80, 0x3F81, 0x3F81, 0xBF81, 0x0000, 0x8000, 0x7F7F, 0x7F80,
                    0xFF80, 0x7FC0, 0xFFFF, 0x3F82, 0x4049, 0xC049, 0x3F80, 0x0080]

# sticky: sticky_key(seed, name) (version 2**64-1), its noise, and the stochastic table's inputs under it
STICKY_KEY_ZERO = (0, "w", 0x5A3BC0CD7ABA3110)
STICKY_KEY_S = (1234, "model.layers.0.self_attn.q_proj.weight", 0x1AEB25616CA0CAF7)
NOISE_S = [
    (0, [0x332A, 0x5F6F, 0xB2FB, 0x32E0, 0xFBCB, 0x9C04, 0x35B7, 0x91EC,
         0x0778, 0xB84F, 0x52D2, 0xCB83, 0x58DC, 0x98FF, 0x2B2A, 0x3254]),
    (2**32 + 5, [0x3CC1, 0x6BA3, 0x3A11, 0x3F24]),
]
STICKY_S_OUT = [0x3F80, 0x3F80, 0x3F81, 0xBF80, 0x0000, 0x8000, 0x7F7F, 0x7F80,
                0xFF80, 0x7FC0, 0xFFFF, 0x3F81, 0x4049, 0xC049, 0x3F80, 0x0080]

# error_feedback: (x bits, residual bits) -> (bf16 bits out, new residual bits)
ERROR_FEEDBACK = [
    (0x3F808000, 0x00000000, 0x3F80, 0x3B800000),  # a tie goes to even; the residual keeps 2**-8
    (0x3F808000, 0x3B800000, 0x3F81, 0x00000000),  # ... and is paid back at the next version
    (0xC0490FDB, 0x00000000, 0xC049, 0xBA7DB000),
    (0x7F7F7FFF, 0x00000000, 0x7F7F, 0x7AFFFE00),  # just below the overflow threshold: residual kept
    (0x7F7F7FFF, 0x7AFFFE00, 0x7F7F, 0x00000000),  # s above the threshold: saturated, residual reset
    (0x7F7F8000, 0x00000000, 0x7F7F, 0x00000000),  # s exactly at the threshold
    (0x7F7FFFFF, 0x00000000, 0x7F7F, 0x00000000),
    (0xFF7FFFFF, 0x00000000, 0xFF7F, 0x00000000),
    (0x7F7FFFFF, 0x7EFFFFFF, 0x7F7F, 0x00000000),  # x + r overflows fp32
    (0xFF7FFFFF, 0xFEFFFFFF, 0xFF7F, 0x00000000),
    (0x7F800000, 0xBF800000, 0x7F80, 0x00000000),  # inf master, finite residual
    (0xFF800000, 0x7F800000, 0xFF80, 0x00000000),  # -inf + inf: x's bits, not the addition's NaN
    (0x7F800001, 0x3F800000, 0x7FC0, 0x00000000),  # signalling NaN master: quieted, payload kept
    (0xFFC12345, 0x7FC00000, 0xFFC1, 0x00000000),  # NaN master, NaN residual: the master's bits
    (0x3F800000, 0xFFA00001, 0x3F80, 0x00000000),  # a NaN residual counts as 0
    (0x3F800000, 0xFF800000, 0x3F80, 0x00000000),  # an infinite residual counts as 0
    (0x80000000, 0x80000000, 0x8000, 0x00000000),  # -0 + -0 = -0
    (0x3F800000, 0xBF800000, 0x0000, 0x00000000),  # 1 + -1 = +0
]

# Keys through a converter (ROUNDING.md §1): a fused QKV of 4 query heads in 2 groups, head dim 1, hidden 2,
# rows q0 q1 k0 v0 q2 q3 k1 v1: (Megatron element, HF name, HF index, key of that name at (1234, 7), fp32 bits in,
# bf16 bits out); under the Megatron-native keys the same elements serve NATIVE_QKV_OUT.
HF_QKV_SHAPE, HF_QKV_HEADS, HF_QKV_GROUPS = (8, 2), 4, 2
HF_QKV = [
    (9, "model.layers.0.self_attn.q_proj.weight", 5, 0x24B966A3AF97FCBD, 0x3F80A000, 0x3F81),
    (13, "model.layers.0.self_attn.k_proj.weight", 3, 0x324F5EB8917F9A66, 0x3F80A000, 0x3F81),
]
NATIVE_QKV = ("decoder.layers.0.self_attention.linear_qkv.weight", 0x3F80)

# Every class of the contract: zeros, infinities, NaNs (quiet, signalling, payloads, negative), subnormals,
# the normal minimum, bf16-exact values, RNE ties, fp32 max, values at and around the bf16 overflow threshold.
SPECIALS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,
    0x7F800001, 0x7FC00000, 0x7FBFFFFF, 0x7FFFFFFF, 0xFF800001, 0xFFC00000, 0xFFFFFFFF, 0x7F810000, 0x7F80FFFF,
    0x00000001, 0x00007FFF, 0x00008000, 0x00008001, 0x0000FFFF, 0x007FFFFF, 0x80000001, 0x807FFFFF, 0x8000FFFF,
    0x00800000, 0x80800000, 0x3F800000, 0xBF800000, 0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x3F807FFF,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F0000, 0x7F7F0001, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7EFFFF, 0xFF7F8000,
    0x7F000000, 0x40490FDB, 0xC0490FDB, 0x00010000, 0x3F7FFFFF, 0x4049FFFF,
]


def fp32_from_bits(bits, device=None) -> torch.Tensor:
    """fp32 tensor holding the given unsigned 32-bit patterns."""
    signed = [b - 2**32 if b >= 2**31 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32, device=device).view(torch.float32)


def bf16_bits(t: torch.Tensor) -> list[int]:
    """Unsigned 16-bit patterns of a bf16 tensor."""
    return [v & 0xFFFF for v in t.reshape(-1).view(torch.int16).tolist()]
