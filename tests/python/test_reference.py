"""Checks of the NumPy reference itself, against ml_dtypes, hand-computed groups and a scalar
re-derivation.  If these fail, every library test built on the reference is meaningless."""
import ml_dtypes
import numpy as np
import pytest
import reference as ref
from conftest import (EXTREME_GLOBAL_SCALES, ORDER_SENSITIVE_USE_D4, groups_4over6_order_sensitive,
                      groups_extreme_scale)

F32 = np.float32


def ulp_neighbourhood(points, k):
    """All fp32 values within k ulps of each point (both signs), as one array."""
    bits = np.asarray(points, np.float32).view(np.int32)
    offs = np.arange(-k, k + 1, dtype=np.int32)
    grid = (bits[:, None] + offs[None, :]).reshape(-1)
    grid = grid[grid >= 0].view(np.float32)
    return np.concatenate([grid, -grid])


def strided_fp32_range(lo, hi, stride):
    """Every `stride`-th fp32 bit pattern between two non-negative floats, both signs."""
    a, b = np.array([lo, hi], np.float32).view(np.int32)
    v = np.arange(a, b, stride, dtype=np.int32).view(np.float32)
    return np.concatenate([v, -v])


# ------------------------------------------------------------------------------------- E2M1
def ml_e2m1(v):
    return np.asarray(v, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def test_r6_constant():
    assert ref.R6.view(np.uint32) == 0x3E2AAAAB
    assert ref.R6 == np.float32(1.0 / 6.0)


def test_e2m1_decode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = ref.e2m1_decode(codes)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # includes -0.0 for 0x8


def test_e2m1_encode_roundtrips_every_code():
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(ref.e2m1_encode(ref.e2m1_decode(codes)), codes)


@pytest.mark.parametrize("tie,down,up", [(0.25, 0, 1), (0.75, 1, 2), (1.25, 2, 3), (1.75, 3, 4),
                                         (2.5, 4, 5), (3.5, 5, 6), (5.0, 6, 7)])
def test_e2m1_ties_and_neighbours_by_hand(tie, down, up):
    t = np.float32(tie)
    even = down if down % 2 == 0 else up
    assert ref.e2m1_encode(t) == even
    assert ref.e2m1_encode(-t) == even | 8
    assert ref.e2m1_encode(np.nextafter(t, F32(0))) == down
    assert ref.e2m1_encode(np.nextafter(t, F32(100))) == up


def test_e2m1_encode_vs_ml_dtypes_near_every_tie():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1, 1.5, 2, 3, 4, 6, 6.5, 7, 8, 100]
    v = np.concatenate([ulp_neighbourhood(ties, 4096), np.float32([0.0, -0.0, 1e-45, -1e-45])])
    assert np.array_equal(ref.e2m1_encode(v), ml_e2m1(v))


def test_e2m1_encode_vs_ml_dtypes_strided_sweep():
    # ~4M fp32 values from 0 to 16 plus the tails: a wide sweep of every binade that matters.
    v = np.concatenate([strided_fp32_range(0.0, 16.0, 263),
                        strided_fp32_range(16.0, 3.0e38, 100003),
                        np.float32([np.inf, -np.inf, 3.4028235e38])])
    assert np.array_equal(ref.e2m1_encode(v), ml_e2m1(v))


def test_e2m1_sign_of_values_rounding_to_zero():
    assert ref.e2m1_encode(F32(-0.1)) == 0x8
    assert ref.e2m1_encode(F32(-0.0)) == 0x8
    assert ref.e2m1_encode(F32(0.1)) == 0x0


# ------------------------------------------------------------------------------------- E4M3
def ml_e4m3_satfinite(v):
    v = np.asarray(v, np.float32)
    return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_e4m3_decode_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = ref.e4m3_decode(b)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert set(np.nonzero(np.isnan(got))[0]) == {0x7F, 0xFF}
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))
    assert got[0x7E] == 448 and got[0x01] == 2.0**-9 and got[0x38] == 1.0


def test_e4m3_encode_every_value_exact():
    b = np.arange(0x7F, dtype=np.uint8)
    assert np.array_equal(ref.e4m3_encode_satfinite(ref.e4m3_decode(b)), b)
    assert np.array_equal(ref.e4m3_encode_satfinite(ref.e4m3_decode(b | 0x80)), b | 0x80)


def test_e4m3_encode_vs_ml_dtypes_near_every_midpoint():
    vals = ref.e4m3_decode(np.arange(0x7F)).astype(np.float64)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (vals[:-1] + vals[1:]) / 2)  # exact in fp32
    v = np.concatenate([ulp_neighbourhood(mids, 512), ulp_neighbourhood(vals, 64)])
    assert np.array_equal(ref.e4m3_encode_satfinite(v), ml_e4m3_satfinite(v))


def test_e4m3_encode_vs_ml_dtypes_strided_sweep():
    v = np.concatenate([strided_fp32_range(0.0, 600.0, 97),
                        strided_fp32_range(600.0, 3.0e38, 100003)])
    assert np.array_equal(ref.e4m3_encode_satfinite(v), ml_e4m3_satfinite(v))


def test_e4m3_encode_saturation_and_nan():
    v = np.float32([448, 449, 463.99, 464, 465, 512, 1e30, np.inf, -np.inf, -1e30, np.nan])
    assert ref.e4m3_encode_satfinite(v).tolist() == [0x7E] * 8 + [0xFE, 0xFE, 0x7F]


def test_e4m3_encode_subnormal_edge_by_hand():
    q = 2.0**-9
    v = np.float32([q / 2, np.nextafter(F32(q / 2), F32(1)), q * 1.5, q * 2.5, q * 7.5, 2.0**-6])
    # 2^-10 ties to 0 (even); just above goes to 0x01; 1.5q ties to 2q; 2.5q to 2q; 7.5q to 8q.
    assert ref.e4m3_encode_satfinite(v).tolist() == [0x00, 0x01, 0x02, 0x02, 0x08, 0x08]


# ------------------------------------------------------------------------------------ Groups
def scalar_quantize_group(x, g, recipe):
    """Second, scalar derivation of docs/FORMAT.md §2 for one group, with ml_dtypes doing the
    rounding (so a shared mistake in the vectorised reference's rounding would show)."""
    x = [F32(v) for v in x]
    if any(np.isnan(v) for v in x):
        return [0] * 16, 0x7F

    def e2m1(v):
        return int(ml_e2m1(np.float32([v]))[0]) | (8 if np.signbit(v) else 0)

    def candidate(R):
        enc = F32(1) / F32(g)
        amax = F32(0)
        for v in x:
            amax = max(amax, abs(v))
        sf = enc * (amax * R)
        sfb = int(ml_e4m3_satfinite(np.float32([sf]))[0])
        sfq = F32(ml_dtypes.float8_e4m3fn(np.float32(min(448, sf))))
        out = F32(0) if sfq == 0 else F32(1) / (sfq * (F32(1) / enc))
        q = [e2m1(v * out) for v in x]
        r = F32(0) if out == 0 else F32(1) / out
        values = np.uint8(q).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
        e = [F32(F32(m) * r) - xi for m, xi in zip(values, x)]
        lo = F32(0)
        for ei in e[:8]:
            lo = F32(lo + F32(ei * ei))
        hi = F32(0)
        for ei in e[8:]:
            hi = F32(hi + F32(ei * ei))
        return q, sfb, F32(lo + hi)

    with np.errstate(all="ignore"):
        q6, s6, err6 = candidate(ref.R6)
        if recipe == "nvfp4":
            return q6, s6
        q4, s4, err4 = candidate(ref.R4)
        return (q4, s4) if err4 < err6 else (q6, s6)


@pytest.mark.parametrize("recipe", ref.RECIPES)
def test_quantize_groups_vs_scalar_derivation(recipe):
    rng = np.random.default_rng(3)
    groups = rng.standard_normal((300, 16)).astype(np.float32)
    groups *= np.exp2(rng.integers(-12, 12, (300, 1))).astype(np.float32)
    groups[::7, 3] = 0.0
    groups[::11, 5] = -0.0
    groups[::13, 1] = np.inf
    groups[::17, 9] = np.nan
    for g in (1.0, 0.37, 3.1e-3, 250.0):
        codes, sfb = ref.quantize_groups(groups, g, recipe)
        for i, grp in enumerate(groups):
            q, s = scalar_quantize_group(grp, g, recipe)
            assert sfb[i] == s, (i, g)
            assert codes[i].tolist() == q, (i, g)


def test_quantize_all_codes_by_hand():
    x = ref.e2m1_decode(np.arange(16))  # 0, .5, ..., 6, -0, ..., -6
    codes, sfb = ref.quantize_groups(x, 1.0)
    # amax 6: sf = 6 * R6 = 1.0000000298 -> fp32 1.0 -> byte 0x38; out = 1: codes are exact.
    assert sfb == 0x38 and codes.tolist() == list(range(16))


def test_quantize_global_scale_by_hand():
    x = np.float32([3, 1.5, -0.75, 0.25] + [0] * 12)
    codes, sfb = ref.quantize_groups(x, 0.5)
    # enc 2, amax*R6 = 0.5, sf 1.0 -> 0x38; out = 1 / (1 * 0.5) = 2: 6, 3, -1.5, 0.5
    assert sfb == 0x38 and codes[:4].tolist() == [7, 5, 0xB, 1] and not codes[4:].any()


def test_quantize_saturated_scale_by_hand():
    x = np.float32([10752, -5376] + [0] * 14)  # sf = 1792 > 448
    codes, sfb = ref.quantize_groups(x, 1.0)
    assert sfb == 0x7E and codes[:2].tolist() == [7, 0xF]  # 24 and -12 saturate to +-6


def test_quantize_zero_and_tiny_groups_by_hand():
    zeros = np.zeros(16, np.float32)
    zeros[1::2] = -0.0
    codes, sfb = ref.quantize_groups(zeros, 1.0)
    assert sfb == 0 and codes.tolist() == [0, 8] * 8
    tiny = np.float32([1e-4, -1e-4] * 8)  # sf = 1.7e-5 rounds to 0: zero group, signs kept
    codes, sfb = ref.quantize_groups(tiny, 1.0)
    assert sfb == 0 and codes.tolist() == [0, 8] * 8
    at_tie = np.float32([6 * 2.0**-10] + [0] * 15)  # sf exactly 2^-10: ties to 0x00
    assert ref.quantize_groups(at_tie, 1.0)[1] == 0
    smallest = np.float32([6 * 2.0**-9] + [0] * 15)  # sf 2^-9: subnormal byte 0x01, out 512
    codes, sfb = ref.quantize_groups(smallest, 1.0)
    assert sfb == 1 and codes[0] == 7


def test_quantize_nan_and_inf_groups_by_hand():
    for pos in (0, 7, 8, 15):
        x = np.ones(16, np.float32)
        x[pos] = np.nan
        x[(pos + 1) % 16] = np.inf
        for recipe in ref.RECIPES:
            codes, sfb = ref.quantize_groups(x, 1.0, recipe)
            assert sfb == 0x7F and not codes.any()
    x = np.float32([np.inf, -np.inf, 1.0, -1.0] + [0.0] * 12)
    for recipe in ref.RECIPES:
        codes, sfb = ref.quantize_groups(x, 1.0, recipe)
        # amax Inf -> 0x7E, out = 1/448: +-Inf -> +-6, +-1 -> ~0 with the sign kept.
        assert sfb == 0x7E and codes[:4].tolist() == [7, 0xF, 0, 8] and not codes[4:].any()


def test_4over6_by_hand():
    x = np.float32([4, 2, 1, 0.5] + [0] * 12)
    # d=6: sf = 4*R6 = 0.667 -> 0.6875 (0x33), out 1.4545: 5.8->6, 2.9->3, 1.45->1.5, .73->.5
    codes, sfb = ref.quantize_groups(x, 1.0, "nvfp4")
    assert sfb == 0x33 and codes[:4].tolist() == [7, 5, 3, 1]
    # d=4: sf = 1.0 exactly, codes exact -> err4 = 0 < err6: the d=4 candidate wins.
    codes, sfb = ref.quantize_groups(x, 1.0, "nvfp4_4over6")
    assert sfb == 0x38 and codes[:4].tolist() == [6, 4, 2, 1]
    # All-codes group is exact with d=6 (err6 = 0), so 6 is kept whatever err4 is.
    codes, sfb = ref.quantize_groups(ref.e2m1_decode(np.arange(16)), 1.0, "nvfp4_4over6")
    assert sfb == 0x38 and codes.tolist() == list(range(16))


def test_4over6_error_summation_order():
    x = groups_4over6_order_sensitive()
    d4_bytes = ref._candidate(x, np.abs(x).max(-1), np.float32(1), ref.R4)[0]
    d6_bytes = ref._candidate(x, np.abs(x).max(-1), np.float32(1), ref.R6)[0]
    assert (d4_bytes != d6_bytes).all()  # so the scale byte tells which candidate was kept
    sfb = ref.quantize_groups(x, 1.0, "nvfp4_4over6")[1]
    assert (sfb == d4_bytes).astype(int).tolist() == ORDER_SENSITIVE_USE_D4
    # Cross-check the decisions with the scalar derivation (its own left-to-right loops).
    for grp, s in zip(x, sfb):
        assert scalar_quantize_group(grp, 1.0, "nvfp4_4over6")[1] == s


def test_invalid_global_scale():
    x = np.ones((3, 16), np.float32)
    for g in (0.0, -1.0, np.nan, np.inf, 1e-45):
        assert not ref.is_valid_global_scale(g)
        with pytest.raises(ValueError):
            ref.quantize_groups(x, g)
        codes, sfb = ref.quantize_groups(x, g, on_invalid_scale="nan")
        assert (sfb == 0x7F).all() and not codes.any()
    assert ref.is_valid_global_scale(3e-38) and ref.is_valid_global_scale(1e30)


def test_pack_nibbles_by_hand():
    codes = np.uint8([1, 2, 0xF, 0x8, 0, 7])
    assert ref.pack_nibbles(codes).tolist() == [0x21, 0x8F, 0x70]
    assert np.array_equal(ref.unpack_nibbles(ref.pack_nibbles(codes)), codes)


# ------------------------------------------------------------------------- store / dequantize
def _poison(N, side, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (N, 2, side), dtype=np.uint8)


@pytest.mark.parametrize("layout,scale_layout", [("HND", "vllm"), ("HND", "linear"),
                                                 ("NHD", "linear")])
def test_store_reference_offsets_by_hand(layout, scale_layout):
    N, T, H, D = 3, 8, 2, 32
    F, S = 18, 2
    cache = _poison(N, H * T * F)
    # token 0 -> page 1, position 5; every group is 'all codes' with scale 1.0 (0x38), but group 1
    # of head 1 is scaled by 2 (byte 0x40) so that heads and groups are distinguishable.
    x = np.tile(ref.e2m1_decode(np.arange(16)), (1, H, 2)).astype(np.float32)
    x[0, 1, 16:] *= 2
    v = -x
    new = ref.store_reference(cache, x, v, [1 * T + 5], 1.0, 1.0, T, H, D, layout, scale_layout)
    t = 5
    expect = cache.copy()
    packed = ref.pack_nibbles(np.arange(16, dtype=np.uint8))  # 0x10, 0x32, ...
    packed_neg = ref.pack_nibbles(np.arange(16, dtype=np.uint8) ^ 8)
    for h in range(H):
        r = h * T + t if layout == "HND" else t * H + h
        expect[1, 0, r * 16: r * 16 + 16] = np.tile(packed, 2)
        expect[1, 1, r * 16: r * 16 + 16] = np.tile(packed_neg, 2)
        for grp in range(S):
            sb = 0x40 if (h, grp) == (1, 1) else 0x38
            expect[1, 0, H * T * 16 + r * S + grp] = sb
            if scale_layout == "vllm":  # h*T*S + (t//4)*4S + 4g + t%4 = h*16 + 8 + 4g + 1
                expect[1, 1, H * T * 16 + h * 16 + 8 + 4 * grp + 1] = sb
            else:
                expect[1, 1, H * T * 16 + r * S + grp] = sb
    assert np.array_equal(new, expect)


def test_store_reference_skips_and_duplicates():
    N, T, H, D = 2, 4, 1, 16
    cache = _poison(N, H * T * 9)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((5, H, D)).astype(np.float32)
    slots = [-1, 8, 3, 3, -7]  # padding, out of range (N*T = 8), then a duplicate of slot 3
    new = ref.store_reference(cache, k, k, slots, 1.0, 1.0, T, H, D, scale_layout="linear")
    only_last = ref.store_reference(cache, k[3:4], k[3:4], [3], 1.0, 1.0, T, H, D,
                                    scale_layout="linear")
    assert np.array_equal(new, only_last)
    changed = np.argwhere(new != cache)
    assert set(changed[:, 0]) == {0}  # only page 0 touched
    assert np.array_equal(ref.store_reference(cache, k[:1], k[:1], [-1], 1.0, 1.0, T, H, D), cache)


@pytest.mark.parametrize("layout,scale_layout", [("HND", "vllm"), ("NHD", "linear")])
def test_store_then_dequantize_reference_is_exact_for_representable_values(layout, scale_layout):
    N, T, H, D = 2, 4, 3, 64
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, (N * T, H, D // 16, 16)).astype(np.uint8)
    codes[..., 0] = 7  # amax = 6 * 2^e in every group -> scale exactly 2^e, codes exact
    scale = np.exp2(rng.integers(-8, 8, (N * T, H, D // 16, 1))).astype(np.float32)
    x = (ref.e2m1_decode(codes) * scale).reshape(N * T, H, D)
    cache = _poison(N, H * T * ref.full_dim(D))
    new = ref.store_reference(cache, x, 2 * x, np.arange(N * T), 1.0, 2.0, T, H, D, layout,
                              scale_layout)
    k, v = ref.dequantize_reference(new, 1.0, 2.0, T, H, D, layout, scale_layout)
    assert np.array_equal(k.reshape(N * T, H, D), x)
    assert np.array_equal(v.reshape(N * T, H, D), 2 * x)


def test_dequantize_reference_nan_and_negative_scales():
    N, T, H, D = 1, 4, 1, 16
    cache = np.zeros((N, 2, H * T * 9), np.uint8)
    cache[0, :, :8] = 0x77  # row 0: all codes 7 (6.0)
    cache[0, 0, 32] = 0x7F  # K row 0 scale NaN
    cache[0, 1, 32] = 0xB8  # V (interleaved, t=0 g=0 at offset 0) scale -1.0
    k, v = ref.dequantize_reference(cache, 1.0, 0.5, T, H, D, "HND", "vllm")
    assert np.isnan(k[0, 0, 0]).all() and (k[0, 1:] == 0).all()
    assert (v[0, 0, 0] == -3.0).all()


def test_extreme_global_scales_are_valid():
    for g in EXTREME_GLOBAL_SCALES:
        assert ref.is_valid_global_scale(g), g
    assert not ref.is_valid_global_scale(2.0**-128)  # 1/g overflows: the first one is the smallest


@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("g", EXTREME_GLOBAL_SCALES)
def test_zero_and_infinite_elements_whatever_out_is(recipe, g):
    """FORMAT.md §2: a zero element is always 0x0/0x8 and an infinite one 0x7/0xF (sign of x),
    also where x*out is 0*Inf or Inf*0 (out = +Inf or 0 at extreme global scales)."""
    x = groups_extreme_scale(g)
    codes, sfb = ref.quantize_groups(x, g, recipe)
    sign = np.signbit(x).astype(np.uint8) << 3
    zero, inf = x == 0, np.isinf(x)
    assert np.array_equal(codes[zero], sign[zero])
    assert np.array_equal(codes[inf], sign[inf] | 7)
    # every scale byte is reached where g allows it (at 2^-128 + 2^-149, 6 * 2^-9 * g underflows)
    if 2.0**-126 <= g <= 1.0:  # (above, 6 * 448 * g overflows)
        assert set(range(1, 0x7F)) <= set(sfb.tolist())
    # the corner is reached: out overflows for some zero-holding group, or underflows for Inf
    enc = np.float32(1) / np.float32(g)
    with np.errstate(all="ignore"):
        out = np.float32(1) / (ref.e4m3_decode(sfb) * (np.float32(1) / enc))
    if g < 1.5e-36:
        assert (np.isinf(out) & zero.any(axis=-1)).any()
    if g > 7.6e35:
        assert ((out == 0) & (sfb == 0x7E) & inf.any(axis=-1)).any()
