"""Independent NumPy reference of the NVFP4 paged KV-cache format (docs/FORMAT.md).

Written from the spec only; it must never import nvfp4kv, so that the library is checked against
an implementation that shares no code with it.  Everything favours being obviously correct over
being fast: the fp32 arithmetic is done with np.float32 operands in exactly the operation order of
FORMAT.md §2 (NumPy never fuses a multiply and an add, and it rounds every fp32 operation RNE).

Decisions taken where FORMAT.md is silent:
- store_reference: if two tokens of one call map to the same slot, the LATER token wins.
- e2m1_encode of a NaN gives magnitude 7 (the ladder's "else"); _candidate never relies on it: a
  NaN product x*out (0*Inf or Inf*0, extreme global scales) is encoded from x as FORMAT.md §2
  decides, and NaN groups of the input are handled before.
- The token-4 interleaved scale layout is accepted for any D (the formula does not need D%64);
  only HND and T%4 == 0 are required, since the offsets are meaningless otherwise.
"""
import numpy as np

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E4M3_MAX_BYTE = 0x7E  # 448
E4M3_NAN_BYTE = 0x7F
R6 = np.uint32(0x3E2AAAAB).view(np.float32)  # fp32(1/6), spelled as in FORMAT.md
R4 = np.float32(0.25)
RECIPES = ("nvfp4", "nvfp4_4over6")
LAYOUTS = ("HND", "NHD")
SCALE_LAYOUTS = ("vllm", "linear")

_F32 = np.float32


def full_dim(D):
    """F = D/2 packed bytes + D/16 scale bytes per row."""
    return D // 2 + D // 16


# ----------------------------------------------------------------------------------------- E2M1
def e2m1_encode(v):
    """fp32 -> E2M1 code, RNE with saturation at 6; sign = sign bit of v (so -0.1 -> 0x8)."""
    v = np.asarray(v, dtype=np.float32)
    m = np.abs(v)
    # The ladder of FORMAT.md §2, literally: "<=" where the tie goes down, "<" where it goes up.
    magnitude = np.select(
        [m <= 0.25, m < 0.75, m <= 1.25, m < 1.75, m <= 2.5, m < 3.5, m <= 5.0],
        [0, 1, 2, 3, 4, 5, 6],
        default=7,
    ).astype(np.uint8)
    return magnitude | (np.signbit(v).astype(np.uint8) << 3)


def e2m1_decode(codes):
    """E2M1 code (low 4 bits) -> fp32 value; 0x8 is -0.0."""
    codes = np.asarray(codes, dtype=np.uint8) & 0xF
    magnitude = E2M1_MAGNITUDES[codes & 0x7]
    return np.where(codes & 0x8, -magnitude, magnitude).astype(np.float32)


# ----------------------------------------------------------------------------------------- E4M3
def e4m3_decode(b):
    """float8_e4m3fn byte -> fp32 value, for all 256 bytes (0x7F / 0xFF are NaN)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    subnormal = mantissa * 2.0**-9  # exponent field 0: m/8 * 2^(1-7)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    value = sign * np.where(exponent == 0, subnormal, normal)
    value = np.where((b & 0x7F) == 0x7F, np.nan, value)
    return value.astype(np.float32)


# The 127 non-negative finite E4M3 values, ascending in byte order 0x00..0x7E.
_E4M3_POSITIVE = e4m3_decode(np.arange(0x7F)).astype(np.float64)


def e4m3_encode_satfinite(v):
    """fp32 -> float8_e4m3fn byte, RNE (subnormals included), |v| > 448 -> 448, NaN -> 0x7F."""
    v = np.asarray(v, dtype=np.float32)
    m = np.abs(v).astype(np.float64)  # exact
    finite_small = np.isfinite(m) & (m < 448.0)
    m_safe = np.where(finite_small, m, 0.0)
    # Quantum of the E4M3 grid at m: 3 mantissa bits below the binade's leading bit; the subnormal
    # range shares the quantum 2^-9 of the first normal binade [2^-6, 2^-5).
    _, ex = np.frexp(m_safe)  # m = f * 2^ex, f in [0.5, 1)  => floor(log2 m) = ex - 1
    binade = np.maximum(ex - 1, -6)
    quantum = np.exp2(binade - 3.0)
    rounded = np.rint(m_safe / quantum) * quantum  # exact scaling; np.rint is ties-to-even
    rounded = np.minimum(rounded, 448.0)  # RNE can round 448 < m < 464 up only to 448 anyway
    byte = np.searchsorted(_E4M3_POSITIVE, rounded).astype(np.uint8)
    assert np.array_equal(_E4M3_POSITIVE[np.minimum(byte, 0x7E)], rounded), "not on the E4M3 grid"
    byte = np.where(finite_small, byte, E4M3_MAX_BYTE).astype(np.uint8)  # +-Inf and >= 448
    byte = byte | (np.signbit(v).astype(np.uint8) << 7)
    return np.where(np.isnan(v), E4M3_NAN_BYTE, byte).astype(np.uint8)


# ------------------------------------------------------------------------------------ Recipe §2
def is_valid_global_scale(g):
    g = np.float32(g)
    with np.errstate(all="ignore"):
        return bool(np.isfinite(g) and g > 0 and np.isfinite(np.float32(1) / g))


def _candidate(x, amax, enc, R):
    """One pass of FORMAT.md §2 with divisor constant R: returns (sfb, out, codes)."""
    with np.errstate(all="ignore"):
        sf = enc * (amax * R)
        sfb = e4m3_encode_satfinite(sf)
        sfq = e4m3_decode(sfb)
        inv_enc = _F32(1) / enc
        out = np.where(sfq == 0, _F32(0), _F32(1) / (sfq * inv_enc)).astype(np.float32)
        prod = x * out[..., None]
        # FORMAT.md §2: where x*out is NaN (0 * Inf with out = +Inf, Inf * 0 with out = 0), q_i is
        # taken from x_i: its sign bit, magnitude 0 for a zero and 7 for an infinite element. (The
        # NaN's own sign bit is platform-defined: x86 sets it.)
        from_x = (np.isinf(x).astype(np.uint8) * 7) | (np.signbit(x).astype(np.uint8) << 3)
        codes = np.where(np.isnan(prod), from_x, e2m1_encode(prod)).astype(np.uint8)
    return sfb, out, codes


def _squared_error(x, out, codes):
    """err of FORMAT.md §2 (4over6): two partial sums of 8, each left to right in fp32, added."""
    with np.errstate(all="ignore"):
        r = np.where(out == 0, _F32(0), _F32(1) / out).astype(np.float32)
        e = e2m1_decode(codes) * r[..., None] - x
        sq = e * e
        lo = sq[..., 0]
        for i in range(1, 8):
            lo = lo + sq[..., i]
        hi = sq[..., 8]
        for i in range(9, 16):
            hi = hi + sq[..., i]
        return lo + hi


def quantize_groups(x, g, recipe="nvfp4", on_invalid_scale="raise"):
    """Quantize groups of 16 (last axis) with global decode scale g.

    Returns (codes uint8 [..., 16], scale_bytes uint8 [...]).
    on_invalid_scale: "raise" (host-checked scale: ValueError) or "nan" (the GPU-tensor path of
    FORMAT.md §2: every group gets scale 0x7F and zero codes).

    Extreme valid g make `out` overflow to +Inf (g < ~1.5e-36, small scale bytes) or underflow to 0
    (g > ~7.6e35, scale byte 0x7E); a zero (resp. infinite) element then gives x*out = NaN, and
    FORMAT.md §2 takes its code from x (see _candidate).
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}")
    x = np.asarray(x, dtype=np.float32)
    assert x.shape[-1] == 16, x.shape
    group_shape = x.shape[:-1]
    if not is_valid_global_scale(g):
        if on_invalid_scale == "raise":
            raise ValueError(f"invalid global scale {g!r}")
        return (np.zeros(x.shape, np.uint8), np.full(group_shape, E4M3_NAN_BYTE, np.uint8))

    enc = _F32(1) / _F32(g)
    nan_group = np.isnan(x).any(axis=-1)
    amax = np.where(np.isnan(x), _F32(0), np.abs(x)).max(axis=-1).astype(np.float32)

    sfb, out, codes = _candidate(x, amax, enc, R6)
    if recipe == "nvfp4_4over6":
        sfb4, out4, codes4 = _candidate(x, amax, enc, R4)
        use4 = _squared_error(x, out4, codes4) < _squared_error(x, out, codes)  # ties keep 6
        sfb = np.where(use4, sfb4, sfb)
        codes = np.where(use4[..., None], codes4, codes)

    sfb = np.where(nan_group, E4M3_NAN_BYTE, sfb).astype(np.uint8)
    codes = np.where(nan_group[..., None], 0, codes).astype(np.uint8)
    return codes, sfb


def pack_nibbles(codes):
    """[..., D] codes -> [..., D/2] bytes; element 2k in the low nibble of byte k."""
    codes = np.asarray(codes, dtype=np.uint8)
    return ((codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)).astype(np.uint8)


def unpack_nibbles(packed):
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


# ---------------------------------------------------------------------------------- Layout §4
def _rows(h, t, T, H, layout):
    if layout == "HND":
        return h * T + t
    if layout == "NHD":
        return t * H + h
    raise ValueError(f"unknown layout {layout!r}")


def _check_scale_layout(scale_layout, layout, T):
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"unknown scale_layout {scale_layout!r}")
    if scale_layout == "vllm" and (layout != "HND" or T % 4 != 0):
        raise ValueError("interleaved V scales need HND and T % 4 == 0")


def scale_offsets(h, t, grp, T, H, D, layout, interleaved):
    """Byte offset (from the start of a side) of the scale of (head h, token t, group grp)."""
    S = D // 16
    base = H * T * D // 2
    if interleaved:
        return base + h * T * S + (t // 4) * 4 * S + 4 * grp + t % 4
    return base + _rows(h, t, T, H, layout) * S + grp


def store_reference(cache_bytes, key, value, slots, k_scale, v_scale, T, H, D, layout="HND",
                    scale_layout="vllm", recipe="nvfp4", on_invalid_scale="raise"):
    """Return a modified copy of cache_bytes (N, 2, H*T*F) after storing key/value [n, H, D].

    key/value must already be fp32 (bf16/fp16 inputs converted exactly by the caller).
    Slots < 0 or >= N*T are skipped.  Duplicate slots: the later token wins (FORMAT.md is silent).
    """
    out = np.array(cache_bytes, dtype=np.uint8, copy=True)
    F, S = full_dim(D), D // 16
    N = out.shape[0]
    assert out.shape == (N, 2, H * T * F), (out.shape, (N, 2, H * T * F))
    assert D % 16 == 0
    _check_scale_layout(scale_layout, layout, T)
    slots = np.asarray(slots).astype(np.int64).reshape(-1)
    key = np.asarray(key, dtype=np.float32)
    value = np.asarray(value, dtype=np.float32)
    assert key.shape == value.shape == (slots.size, H, D), (key.shape, value.shape, slots.size)

    # Keep only the last token of every valid slot, so the fancy-index writes below never have
    # duplicate targets (NumPy does not promise an order for those).
    valid = np.nonzero((slots >= 0) & (slots < N * T))[0]
    last_first = valid[::-1]
    _, first = np.unique(slots[last_first], return_index=True)
    keep = np.sort(last_first[first])
    page = (slots[keep] // T)[:, None, None]
    t = (slots[keep] % T)[:, None, None]
    h = np.arange(H)[None, :, None]
    grp = np.arange(S)[None, None, :]
    byte = np.arange(D // 2)[None, None, :]
    row = _rows(h, t, T, H, layout)

    for side, (x, g) in enumerate(((key, k_scale), (value, v_scale))):
        xs = x[keep].reshape(keep.size, H, S, 16)
        codes, sfb = quantize_groups(xs, g, recipe, on_invalid_scale)
        out[page, side, row * (D // 2) + byte] = pack_nibbles(codes.reshape(keep.size, H, D))
        interleaved = scale_layout == "vllm" and side == 1
        out[page, side, scale_offsets(h, t, grp, T, H, D, layout, interleaved)] = sfb
    return out


def dequantize_reference(cache_bytes, k_scale, v_scale, T, H, D, layout="HND",
                         scale_layout="vllm"):
    """(N, 2, H*T*F) bytes -> (key, value), each fp32 (N, T, H, D): (e2m1 * sfq) * g in fp32."""
    cache = np.asarray(cache_bytes, dtype=np.uint8)
    N = cache.shape[0]
    F, S = full_dim(D), D // 16
    assert cache.shape == (N, 2, H * T * F)
    _check_scale_layout(scale_layout, layout, T)
    t = np.arange(T)[:, None, None]
    h = np.arange(H)[None, :, None]
    grp = np.arange(S)[None, None, :]
    row = _rows(h[..., 0], t[..., 0], T, H, layout)  # (T, H)
    result = []
    for side, g in ((0, k_scale), (1, v_scale)):
        b = cache[:, side]
        packed = b[:, : H * T * D // 2].reshape(N, H * T, D // 2)[:, row]  # (N, T, H, D/2)
        values = e2m1_decode(unpack_nibbles(packed))
        interleaved = scale_layout == "vllm" and side == 1
        sfq = e4m3_decode(b[:, scale_offsets(h, t, grp, T, H, D, layout, interleaved)])  # (N,T,H,S)
        sfq = np.repeat(sfq, 16, axis=-1)  # (N, T, H, D)
        with np.errstate(all="ignore"):
            result.append(((values * sfq) * _F32(g)).astype(np.float32))
    return tuple(result)
