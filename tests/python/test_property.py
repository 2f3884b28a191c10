"""Property-based tests (hypothesis) over the argument space of store, dequantize and gather_dequant.

The property, for every drawn call: it either
  - raises TypeError or ValueError whose message names one of the entry point's arguments (the
    one the drawn defect is about, when the draw put exactly one defect in), with EVERY buffer it
    was given unchanged, guard bytes around each buffer included; or
  - succeeds and writes exactly the reference's bytes (tests/python/reference.py, the independent
    NumPy reference of docs/FORMAT.md): cache bytes for store, output values bit for bit (any NaN
    equals any NaN) for dequantize and gather_dequant; nothing outside the outputs changes.
Whether a call must raise or succeed is predicted from the draw (a list of defects); a few draws
whose outcome the contract leaves open (negative strides, a read-only cache given to a read)
accept either, but a success must still be exact.

Every buffer (caches, key/value, slot_mapping, block tables, sequence lengths, scale tensors,
outputs) is a view into the middle of a larger byte buffer of random bytes, so a byte written or
left out of place anywhere shows up.

Budget: a fixed, derandomized number of examples per test in CI (PER_TEST below: 500 store, 400
dequantize, 500 gather_dequant calls; about 25 s on 2 cores without a GPU). Long runs on demand:
    NVFP4KV_PROPERTY_EXAMPLES=5000 python -m pytest tests/python/test_property.py -q
and NVFP4KV_PROPERTY_SEED=<int> draws a different (reproducible) sequence instead of the
derandomized one. The CUDA variants run the same draws through torch tensors on the GPU and
compare every byte against the CPU path (skipped without a CUDA device and a CUDA build).
"""
import os
import re
import zlib

import numpy as np
import pytest
import reference as ref
from conftest import mixed_tokens
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nvfp4kv = pytest.importorskip("nvfp4kv")

HAS_CUDA = bool(torch.cuda.is_available() and nvfp4kv.build_info()["cuda_available"])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of nvfp4kv")

# ------------------------------------------------------------------------------ budget / seeding
PER_TEST = {"store": 500, "dequantize": 400, "gather": 500, "cuda": 150}
_ENV_EXAMPLES = os.environ.get("NVFP4KV_PROPERTY_EXAMPLES", "").strip()
_ENV_SEED = os.environ.get("NVFP4KV_PROPERTY_SEED", "").strip()


def budget(kind):
    """settings(...) (+ seed) for one property: the CI count, or NVFP4KV_PROPERTY_EXAMPLES."""
    n = int(_ENV_EXAMPLES) if _ENV_EXAMPLES else PER_TEST[kind]
    s = settings(max_examples=n, deadline=None, database=None, derandomize=not _ENV_SEED,
                 suppress_health_check=list(HealthCheck), print_blob=True)

    def deco(f):
        f = s(f)
        return seed(int(_ENV_SEED))(f) if _ENV_SEED else f
    return deco


# ------------------------------------------------------------------------------------- dtypes
try:
    import ml_dtypes
    _BF16_NP = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test extra
    _BF16_NP = None

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int32": 4, "int64": 8,
            "int16": 2, "int8": 1, "uint8": 1}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode(values, dtype):
    """fp32/int values -> the raw little-endian bytes of `dtype` (RNE for the float casts)."""
    values = np.asarray(values)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "bfloat16":
            if _BF16_NP is not None:
                arr = values.astype(np.float32).astype(_BF16_NP)
            else:
                t = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16)
                return t.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = values.astype(dtype)
    return np.ascontiguousarray(arr).view(_UINT[ITEMSIZE[dtype]])


def decode(bits, dtype):
    """Raw element bits -> fp32 values (exact for the three float dtypes)."""
    bits = np.asarray(bits).astype(_UINT[ITEMSIZE[dtype]])
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(dtype).astype(np.float32)


def is_nan_bits(bits, dtype):
    b = np.asarray(bits).astype(np.uint64)
    if dtype == "float32":
        return (b & 0x7FFFFFFF) > 0x7F800000
    if dtype == "float16":
        return (b & 0x7FFF) > 0x7C00
    return (b & 0x7FFF) > 0x7F80  # bfloat16


def torch_dtype(name):
    return getattr(torch, name)


# ---------------------------------------------------------------------------- guarded buffers
class Buf:
    """A flat uint8 buffer: random guard bytes, a body (what the views cover), more guard bytes.

    `flat` is the backend object (numpy array or torch tensor on `device`); views are made with
    `view(dtype, shape, strides, offset)` (element units of `dtype`, offset from the body start,
    which is 16-byte aligned in the buffer)."""

    def __init__(self, env, rng, body_bytes, fill=None):
        self.env = env
        self.pre = 16 * int(rng.integers(1, 5))
        post = 16 * int(rng.integers(1, 5))
        body = -(-max(int(body_bytes), 0) // 16) * 16
        self.size = self.pre + body + post
        host = rng.integers(0, 256, self.size, dtype=np.uint8)
        if fill is not None:
            fill = np.asarray(fill, np.uint8).reshape(-1)
            host[self.pre:self.pre + fill.size] = fill
        self.initial = host.copy()
        self.flat = env.from_numpy(host)

    def snapshot(self):
        return self.env.to_numpy(self.flat).copy()

    def view(self, dtype, shape, strides, offset=0):
        """A `dtype` view of the body: element strides/offset (may be 0 or, numpy only, <0)."""
        isz = ITEMSIZE[dtype]
        assert self.pre % isz == 0 and self.size % isz == 0
        start = self.pre // isz + int(offset)
        return self.env.strided(self.flat, dtype, tuple(shape), tuple(strides), start)

    def write(self, offset_bytes, raw):
        """Write raw bytes into the body (before the call: building the inputs)."""
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        lo = self.pre + int(offset_bytes)
        assert 0 <= lo and lo + raw.size <= self.size
        host = self.env.to_numpy(self.flat).copy()
        host[lo:lo + raw.size] = raw
        self.flat = self.env.replace(self.flat, host)
        self.initial = host.copy()


class Env:
    """numpy, or torch on a device; every array of a call comes from here."""

    def __init__(self, backend, device="cpu"):
        self.backend, self.device = backend, device

    def from_numpy(self, host):
        if self.backend == "numpy":
            return host.copy()
        return torch.from_numpy(host.copy()).to(self.device)

    def replace(self, flat, host):
        if self.backend == "numpy":
            flat[...] = host
        else:
            flat.copy_(torch.from_numpy(host))
        return flat

    def to_numpy(self, x):
        if self.backend == "numpy":
            return x
        return x.detach().cpu().numpy()

    def strided(self, flat, dtype, shape, strides, start):
        isz = ITEMSIZE[dtype]
        if self.backend == "numpy":
            typed = flat.view(np.dtype(dtype))
            return np.lib.stride_tricks.as_strided(typed[start:], shape=shape,
                                                   strides=tuple(s * isz for s in strides),
                                                   writeable=True)
        typed = flat.view(torch_dtype(dtype))
        return torch.as_strided(typed, shape, strides, start)

    def array(self, values, dtype, rng, layout="contiguous"):
        """A small int/float vector or matrix (an index argument, a scale tensor) in a Buf.

        layout: "contiguous", "strided" (every other element), "reversed" (numpy: negative
        stride). Returns (Buf, view)."""
        values = np.asarray(values)
        isz = ITEMSIZE[dtype]
        shape = values.shape
        n = values.size
        step = 2 if layout == "strided" else 1
        buf = Buf(self, rng, (n * step + 2) * isz)
        raw = encode(values, dtype) if dtype in ("float32", "float16", "bfloat16") \
            else np.ascontiguousarray(values.astype(dtype))
        raw = raw.reshape(-1)
        if layout == "contiguous" or n == 0:
            buf.write(0, raw)
            strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
            return buf, buf.view(dtype, shape, strides, 0)
        if layout == "strided":
            spread = np.zeros(2 * n, raw.dtype)
            spread[::2] = raw
            spread[1::2] = rng.integers(0, 100, n).astype(raw.dtype)  # junk between the entries
            buf.write(0, spread[:2 * n - 1])
            strides = [2 * int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
            return buf, buf.view(dtype, shape, strides, 0)
        assert layout == "reversed" and self.backend == "numpy" and len(shape) == 1
        buf.write(0, raw[::-1].copy())
        return buf, buf.view(dtype, shape, (-1,), n - 1)


def elem_offsets(shape, strides, base):
    """Element offsets of every index of a strided view (int64 array of `shape`)."""
    off = np.full(shape, int(base), np.int64)
    for i, (n, s) in enumerate(zip(shape, strides)):
        idx = np.arange(n, dtype=np.int64) * int(s)
        off = off + idx.reshape((1,) * i + (n,) + (1,) * (len(shape) - i - 1))
    return off


# ------------------------------------------------------------------------------------- caches
class Cache:
    """An NVFP4 cache as the library sees it, with each side's bytes placed in guarded buffers.

    form: "5d" (N,2,T,H,F) HND/NHD strides, "packed4d" (N,2H,T,F), "sides" (two (N,T,H,F) views
    of one buffer, V after K (or before: swap) with a gap), "apart" (two sides in two buffers
    with their own page strides). The K side of page p is the H*T*Fk bytes at
    k_off + p*k_ps in k_buf (likewise V)."""

    def __init__(self, env, rng, N, T, H, D, Dv, form, layout, pad, gap, swap, content=None):
        self.N, self.T, self.H, self.D, self.Dv = N, T, H, D, Dv
        self.form, self.layout = form, layout
        F, Fv = ref.full_dim(D), ref.full_dim(Dv)
        self.F, self.Fv = F, Fv
        sk, sv = H * T * F, H * T * Fv
        self.sk, self.sv = sk, sv
        tk, hk = (F, T * F) if layout == "HND" else (H * F, F)
        tv, hv = (Fv, T * Fv) if layout == "HND" else (H * Fv, Fv)
        if form in ("5d", "packed4d"):
            assert D == Dv and gap == 0 and not swap
            ps = 2 * sk + pad
            self.k_buf = self.v_buf = Buf(env, rng, N * ps)
            self.k_off, self.v_off, self.k_ps, self.v_ps = 0, sk, ps, ps
            if form == "5d":
                self.kv_cache = self.k_buf.view("uint8", (N, 2, T, H, F), (ps, sk, tk, hk, 1))
            else:
                assert layout == "HND"
                self.kv_cache = self.k_buf.view("uint8", (N, 2 * H, T, F), (ps, T * F, F, 1))
            self.value_cache = None
        elif form == "sides":
            ps = sk + sv + gap + pad
            self.k_buf = self.v_buf = Buf(env, rng, N * ps)
            self.k_ps = self.v_ps = ps
            self.k_off, self.v_off = (sv + gap, 0) if swap else (0, sk + gap)
            self.kv_cache = self.k_buf.view("uint8", (N, T, H, F), (ps, tk, hk, 1), self.k_off)
            self.value_cache = self.v_buf.view("uint8", (N, T, H, Fv), (ps, tv, hv, 1), self.v_off)
        else:  # apart
            self.k_ps, self.v_ps = sk + pad, sv + gap
            self.k_buf, self.v_buf = Buf(env, rng, N * self.k_ps), Buf(env, rng, N * self.v_ps)
            self.k_off = self.v_off = 0
            self.kv_cache = self.k_buf.view("uint8", (N, T, H, F), (self.k_ps, tk, hk, 1))
            self.value_cache = self.v_buf.view("uint8", (N, T, H, Fv), (self.v_ps, tv, hv, 1))
        self.bufs = [self.k_buf] if self.k_buf is self.v_buf else [self.k_buf, self.v_buf]

    def kwargs(self):
        kw = {"kv_cache": self.kv_cache}
        if self.value_cache is not None:
            kw["value_cache"] = self.value_cache
        return kw

    def _side_index(self, buf, off, ps, nbytes):
        return (buf.pre + off + ps * np.arange(self.N, dtype=np.int64)[:, None]
                + np.arange(nbytes, dtype=np.int64)[None, :])

    def side_bytes(self, snaps):
        """(K bytes (N, sk), V bytes (N, sv)) from snapshots {id(buf): bytes}."""
        ki = self._side_index(self.k_buf, self.k_off, self.k_ps, self.sk)
        vi = self._side_index(self.v_buf, self.v_off, self.v_ps, self.sv)
        return snaps[id(self.k_buf)][ki], snaps[id(self.v_buf)][vi]

    def put_side_bytes(self, snaps, kb, vb):
        ki = self._side_index(self.k_buf, self.k_off, self.k_ps, self.sk)
        vi = self._side_index(self.v_buf, self.v_off, self.v_ps, self.sv)
        snaps[id(self.k_buf)][ki] = kb
        snaps[id(self.v_buf)][vi] = vb


def ref_layout(cache):
    """The layout the library reads off the strides: HND whenever H or T is 1 (same bytes), and
    none for a cache of no pages, whose strides show none (NumPy 1.x exports none for an empty
    array): read as HND, so that the 'vllm' profile is never refused for it."""
    return "HND" if cache.H == 1 or cache.T == 1 or cache.N == 0 else cache.layout


def ref_store(cache, snaps, k32, v32, slots, ks, vs, recipe, scale_layout):
    """Expected snapshots after a store: each side through reference.store_reference."""
    kb, vb = cache.side_bytes(snaps)
    T, H, lay = cache.T, cache.H, ref_layout(cache)
    slots = np.asarray(slots, np.int64)
    # K: store_reference on a cache whose both sides are the K side (linear scales for side 0).
    newk = ref.store_reference(np.stack([kb, kb], 1), k32, k32, slots, ks, ks, T, H, cache.D, lay,
                               "linear", recipe)[:, 0]
    newv = ref.store_reference(np.stack([vb, vb], 1), v32, v32, slots, vs, vs, T, H, cache.Dv, lay,
                               scale_layout, recipe)[:, 1]
    out = {k: v.copy() for k, v in snaps.items()}
    cache.put_side_bytes(out, newk, newv)
    return out


def ref_dequant(cache, snaps, ks, vs, scale_layout):
    """(key fp32 (N,T,H,D), value fp32 (N,T,H,Dv)) of the cache bytes, from the reference."""
    kb, vb = cache.side_bytes(snaps)
    T, H, lay = cache.T, cache.H, ref_layout(cache)
    k = ref.dequantize_reference(np.stack([kb, kb], 1), ks, ks, T, H, cache.D, lay, "linear")[0]
    v = ref.dequantize_reference(np.stack([vb, vb], 1), vs, vs, T, H, cache.Dv, lay,
                                 scale_layout)[1]
    return k, v


# ------------------------------------------------------------------------------ call outcomes
class Expect:
    """What a drawn call must do: defects (each a set of argument names and exception types)."""

    def __init__(self):
        self.defects = []  # (label, names, exc types)
        self.open = []  # labels of draws whose outcome the contract leaves open

    def bad(self, label, names, exc=(ValueError,)):
        self.defects.append((label, set(names), tuple(exc)))

    def either(self, label):
        self.open.append(label)

    extra_names = frozenset()
    extra_excs = ()

    @property
    def must_raise(self):
        return bool(self.defects)


_PREFIX = re.compile(r"^nvfp4kv_\w+: ")
_LEAD = re.compile(r"^(\w+):")


def named_argument(msg):
    """The argument a message leads with: 'nvfp4kv_store: key: ...' -> 'key'."""
    m = _LEAD.match(_PREFIX.sub("", msg, count=1))
    return m.group(1) if m else None


def snapshot_all(bufs):
    return {id(b): b.snapshot() for b in bufs}


def assert_unchanged(bufs, before, what):
    for b in bufs:
        now = b.snapshot()
        if not np.array_equal(now, before[id(b)]):
            bad = np.nonzero(now != before[id(b)])[0]
            raise AssertionError(f"{what}: {bad.size} bytes changed in a buffer of {b.size} "
                                 f"(body at {b.pre}); first offsets {bad[:8].tolist()}")


def run_call(call, expect, bufs, params, names):
    """Run `call`; on an exception check the error contract and that nothing changed. Returns
    (ok, result, snapshots_before)."""
    before = snapshot_all(bufs)
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 - sorted out below
        if not isinstance(e, (TypeError, ValueError)):
            raise
        msg = str(e)
        arg = named_argument(msg)
        assert arg in names, f"message names no argument of the call ({arg!r}): {msg!r}"
        if not expect.must_raise:
            assert expect.open, (f"a valid call raised {type(e).__name__}: {msg!r}\n"
                                 f"params: {params}")
        else:
            allowed = set().union(*(d[1] for d in expect.defects)) | expect.extra_names
            excs = tuple(set(x for d in expect.defects for x in d[2]) | set(expect.extra_excs))
            assert isinstance(e, excs), f"{type(e).__name__} ({msg!r}); expected {excs} for " \
                f"{[d[0] for d in expect.defects]}"
            assert arg in allowed, (f"message names {arg!r}, expected one of {sorted(allowed)} "
                                    f"for {[d[0] for d in expect.defects]}: {msg!r}")
        assert_unchanged(bufs, before, f"after {type(e).__name__} ({msg!r})")
        return False, None, before
    assert not expect.must_raise, (f"no error, but the draw has defects "
                                   f"{[d[0] for d in expect.defects]}; params: {params}")
    return True, result, before


def assert_floats_at(snap_now, buf, dtype, offsets, want32, what):
    """The elements of `buf` at element offsets `offsets` (body-relative) hold `want32` rounded
    to dtype, bit for bit; NaN where the reference has NaN (any payload)."""
    isz = ITEMSIZE[dtype]
    offsets = np.asarray(offsets, np.int64).reshape(-1)
    byte = buf.pre + offsets[:, None] * isz + np.arange(isz)[None, :]
    got = snap_now[byte].copy().view(_UINT[isz]).reshape(-1)
    want = encode(np.asarray(want32, np.float32).reshape(-1), dtype).reshape(-1)
    wnan = is_nan_bits(want, dtype)
    gnan = is_nan_bits(got, dtype)
    bad = np.where(wnan, ~gnan, got != want)
    if bad.any():
        i = np.nonzero(bad)[0]
        raise AssertionError(f"{what}: {i.size} of {bad.size} {dtype} elements differ from the "
                             f"reference; first at {i[:6].tolist()}: got {got[i[:6]]} want "
                             f"{want[i[:6]]}")


def written_mask_bytes(buf, dtype, offsets):
    isz = ITEMSIZE[dtype]
    offsets = np.asarray(offsets, np.int64).reshape(-1)
    return (buf.pre + offsets[:, None] * isz + np.arange(isz)[None, :]).reshape(-1)


def assert_rest_unchanged(buf, before, now, written, what):
    keep = np.ones(buf.size, bool)
    keep[written] = False
    diff = np.nonzero(keep & (now != before))[0]
    assert diff.size == 0, f"{what}: {diff.size} bytes outside the written elements changed " \
                           f"(buffer offsets {diff[:8].tolist()}, body at {buf.pre})"


# ------------------------------------------------------------------------------ shared draws
VALID_D = (16, 32, 48, 64, 128, 256, 512)
BAD_D = (8, 24, 40, 528, 1024)


def draw_geometry(data, env_backend, gpu=False):
    """N, T, H, D, Dv, form, layout, pad, gap, swap."""
    d = data.draw
    N = d(st.integers(0, 3), label="N")
    T = d(st.sampled_from((1, 2, 3, 4, 5, 8, 16)), label="T")
    H = d(st.integers(1, 3), label="H")
    D = d(st.sampled_from(VALID_D), label="D")
    if D == 512:
        T, H = min(T, 4), min(H, 2)
    form = d(st.sampled_from(("5d", "packed4d", "sides", "apart")), label="form")
    layout = "HND" if form == "packed4d" else d(st.sampled_from(("HND", "NHD")), label="layout")
    Dv = D
    if form in ("sides", "apart") and d(st.integers(0, 3), label="Dv_differs") == 0:
        Dv = d(st.sampled_from((16, 64, 128)), label="Dv")
    pad = d(st.sampled_from((0, 0, 8, 37)), label="pad")
    gap = d(st.sampled_from((0, 0, 5))) if form in ("sides", "apart") else 0
    swap = d(st.booleans(), label="swap") if form == "sides" else False
    return dict(N=N, T=T, H=H, D=D, Dv=Dv, form=form, layout=layout, pad=pad, gap=gap, swap=swap)


def draw_scale(data, label, env, rng, expect, gpu=False):
    """A global scale: float / numpy float32 / 1-element tensor; valid or not.

    Returns (object to pass, fp32 value for the reference, [Buf] of a tensor)."""
    d = data.draw
    if gpu:  # host scale tensors: the CPU and CUDA calls then check them the same way
        env = Env("torch", "cpu")
    kind = d(st.sampled_from(("float", "float", "np", "tensor", "tensor0d", "bad")), label=f"{label}_kind")
    if kind == "bad":
        bad = d(st.sampled_from(("zero", "neg", "inf", "nan", "denorm", "f32_overflow", "bool",
                                 "str", "tensor_f64", "tensor_2", "tensor_nan", "tensor_neg")),
                label=f"{label}_bad")
        val = {"zero": 0.0, "neg": -0.5, "inf": float("inf"), "nan": float("nan"),
               "denorm": 1e-39, "f32_overflow": 1e39}.get(bad)
        if val is not None:
            expect.bad(f"{label}={bad}", {label})
            return val, None, []
        if bad == "bool":
            expect.bad(f"{label}=bool", {label}, (TypeError,))
            return True, None, []
        if bad == "str":
            expect.bad(f"{label}=str", {label}, (TypeError, ValueError))
            return "0.5", None, []
        if bad == "tensor_f64":
            expect.bad(f"{label}=float64 tensor", {label}, (TypeError,))
            b, t = env.array(np.array([0.5]), "float64", rng)
            return t, None, [b]
        if bad == "tensor_2":
            expect.bad(f"{label}=2 elements", {label})
            b, t = env.array(np.array([0.5, 0.5], np.float32), "float32", rng)
            return t, None, [b]
        v = float("nan") if bad == "tensor_nan" else -1.0
        expect.bad(f"{label}={bad}", {label})
        b, t = env.array(np.array([v], np.float32), "float32", rng)
        return t, None, [b]
    e = d(st.integers(-60, 60), label=f"{label}_exp")
    m = d(st.sampled_from((1.0, 1.5, 1.1, 1.75, 1.3333)), label=f"{label}_mant")
    g = float(np.float32(m * 2.0 ** e))
    if kind == "float":
        return g, np.float32(g), []
    if kind == "np":
        return np.float32(g), np.float32(g), []
    shape = (1,) if kind == "tensor" else ()
    b, t = env.array(np.full(shape, g, np.float32), "float32", rng)
    return t, np.float32(g), [b]


def draw_cache(data, env, rng, expect, geo, names_k, for_write):
    """Builds the cache for the geometry, with optional cache defects. Returns (Cache, kwargs)."""
    d = data.draw
    c = Cache(env, rng, geo["N"], geo["T"], geo["H"], geo["D"], geo["Dv"], geo["form"],
              geo["layout"], geo["pad"], geo["gap"], geo["swap"])
    kw = c.kwargs()
    if c.form == "sides" and c.D != c.Dv and c.N > 0:
        # Known limitation (see test_sides_of_different_head_sizes_in_one_allocation below): two
        # sides of different F carved from one allocation are rejected as overlapping (the overlap
        # test is exact only for views of equal shapes and strides), although no byte is shared.
        expect.either("sides of different head sizes in one allocation")
        expect.extra_names = frozenset({"value_cache", "key_cache"})
        expect.extra_excs = (ValueError,)
    defect = d(st.sampled_from(("none",) * 8 + ("int8", "readonly", "bad_strides", "v_overlap",
                                               "v_layout", "rank3")), label="cache_defect")
    kname = {"key_cache", "kv_cache"}
    if defect == "int8":
        which = "value_cache" if c.value_cache is not None and d(st.booleans()) else "kv_cache"
        x = kw[which]
        kw[which] = x.view(np.int8) if env.backend == "numpy" else x.view(torch.int8)
        expect.bad("cache int8", kname | {"value_cache"}, (TypeError,))
    elif defect == "readonly" and env.backend == "numpy":
        # a fresh read-only view of the same bytes (the library never writes through it)
        which = "value_cache" if c.value_cache is not None and d(st.booleans()) else "kv_cache"
        x = kw[which]
        ro = np.lib.stride_tricks.as_strided(x, x.shape, x.strides, writeable=False)
        kw[which] = ro
        if for_write:
            expect.bad("read-only cache", kname | {"value_cache"})
        else:
            expect.either("read-only cache given to a read")
    elif defect == "bad_strides" and c.T > 1 and c.H > 1 and c.N > 0:  # an empty one's may not show (ref_layout)
        x = kw["kv_cache"]
        # T and H strides both F: neither HND nor NHD (the view addresses rows twice)
        if c.form == "5d":
            kw["kv_cache"] = c.k_buf.view("uint8", x.shape, (c.k_ps, c.sk, c.F, c.F, 1), 0)
        elif c.form == "packed4d":
            kw["kv_cache"] = c.k_buf.view("uint8", x.shape, (c.k_ps, c.F, c.F, 1), 0)
        else:
            kw["kv_cache"] = c.k_buf.view("uint8", x.shape, (c.k_ps, c.F, c.F, 1), c.k_off)
        expect.bad("cache strides", kname)
    elif defect == "v_overlap" and c.form == "sides" and c.N > 0:
        x = kw["value_cache"]
        strides = x.strides if env.backend == "numpy" else x.stride()
        start = max(0, min(c.k_off + 1, c.k_ps - c.sv))  # within the page, across the K side
        kw["value_cache"] = c.k_buf.view("uint8", x.shape, strides, start)
        expect.bad("value_cache overlaps key_cache", kname | {"value_cache"})
    elif defect == "v_layout" and c.value_cache is not None and c.T > 1 and c.H > 1 and c.N > 0:
        other = "NHD" if c.layout == "HND" else "HND"
        tv, hv = (c.Fv, c.T * c.Fv) if other == "HND" else (c.H * c.Fv, c.Fv)
        kw["value_cache"] = c.v_buf.view("uint8", (c.N, c.T, c.H, c.Fv), (c.v_ps, tv, hv, 1), c.v_off)
        expect.bad("sides of different layouts", kname | {"value_cache"})
    elif defect == "rank3":
        x = kw["kv_cache"]
        kw["kv_cache"] = c.k_buf.view("uint8", (max(c.N, 1), 2, 3), (6, 3, 1), 0)
        expect.bad("cache rank 3", kname | {"value_cache"})
    return c, kw


def check_profile(expect, cache, scale_layout):
    """The 'vllm' profile's conditions, on the geometry the library reads."""
    if scale_layout != "vllm":
        return
    names = {"scale_layout", "kv_cache", "key_cache", "value_cache"}
    if ref_layout(cache) != "HND":
        expect.bad("vllm on NHD", names)
    if cache.T % 4:
        expect.bad("vllm with T % 4", names)
    if cache.Dv % 64:
        expect.bad("vllm with Dv % 64", names)


def draw_scale_layout(data, expect):
    s = data.draw(st.sampled_from(("vllm", "linear", "linear", "vllm", "bogus")), label="scale_layout")
    if s == "bogus":
        expect.bad("scale_layout unknown", {"scale_layout"})
    return s


# ------------------------------------------------------------------------------------- store
STORE_NAMES = {"key", "value", "kv_cache", "key_cache", "value_cache", "slot_mapping", "k_scale",
               "v_scale", "recipe", "scale_layout", "stream", "workspace"}


def place_tokens(env, rng, vals, dtype, mode):
    """key or value [n, H, D] of `dtype` holding `vals` (fp32, already dtype-exact), in a guarded
    buffer with the given stride mode. Returns (Buf, view)."""
    n, H, D = vals.shape
    isz = ITEMSIZE[dtype]
    if mode == "transposed":  # physical [H][n][D]
        strides, extent, base = (D, n * D, 1), n * H * D, 0
    elif mode == "padded":  # rows of D+16, tokens of H*(D+16)+8
        strides = (H * (D + 16) + 8, D + 16, 1)
        extent, base = n * strides[0] + 8, 8
    elif mode == "bcast":  # every token the same memory (token stride 0)
        strides, extent, base = (0, D, 1), H * D, 0
    elif mode == "last2":
        strides, extent, base = (2 * H * D, 2 * D, 2), 2 * n * H * D, 0
    elif mode == "reversed":  # numpy: negative token stride
        strides, extent, base = (-H * D, D, 1), n * H * D, max(n - 1, 0) * H * D
    else:
        strides, extent, base = (H * D, D, 1), n * H * D, 0
    buf = Buf(env, rng, (extent + 16) * isz)
    if n and H and D:
        offs = elem_offsets((n, H, D), strides, base)
        bits = encode(vals, dtype)
        host = buf.snapshot()
        byte = buf.pre + offs[..., None] * isz + np.arange(isz)
        host[byte] = bits.reshape(n, H, D, 1).view(np.uint8).reshape(n, H, D, isz)
        buf.flat = env.replace(buf.flat, host)
        buf.initial = host.copy()
    return buf, buf.view(dtype, (n, H, D), strides, base)


def tokens(rng, n, H, D):
    """n random tokens [n, H, D] with NaN/Inf/zero/tiny/huge groups (conftest.mixed_tokens)."""
    if n == 0 or D % 16:
        return (rng.standard_normal((n, H, D)) * 3).astype(np.float32)
    return mixed_tokens(rng, n, H, D)


def draw_store(data, env, gpu=False):
    d = data.draw
    expect = Expect()
    rng = np.random.default_rng(d(st.integers(0, 2**32 - 1), label="seed"))
    geo = draw_geometry(data, env.backend, gpu)
    cache, kw = draw_cache(data, env, rng, expect, geo, None, for_write=True)
    N, T, H, D, Dv = cache.N, cache.T, cache.H, cache.D, cache.Dv
    bufs = list(cache.bufs)
    n = d(st.integers(0, 8), label="n")
    dtypes = ("float32", "float16") + (("bfloat16",) if env.backend == "torch" else ())
    dtype = d(st.sampled_from(dtypes), label="dtype")
    kd, vd = D, Dv
    hd = d(st.sampled_from(("ok",) * 10 + ("bad_D", "Dv_mismatch", "heads")), label="head_defect")
    if hd == "bad_D":
        kd = vd = d(st.sampled_from(BAD_D), label="bad_D")
        expect.bad("key head size", {"key", "value", "kv_cache", "key_cache"})
    elif hd == "Dv_mismatch":
        vd = Dv + 16 if Dv < 512 else Dv - 16
        expect.bad("value head size vs cache", {"value", "kv_cache", "value_cache"})
    kh = H + 1 if hd == "heads" else H
    if hd == "heads":
        expect.bad("key heads", {"key", "value", "kv_cache", "key_cache"})
    kvals, vvals = tokens(rng, n, kh, kd), tokens(rng, n, kh, vd)
    modes = ("contiguous", "contiguous", "transposed", "padded", "bcast", "last2") + \
            (("reversed",) if env.backend == "numpy" else ())
    kmode = d(st.sampled_from(modes), label="key_strides")
    vmode = d(st.sampled_from(modes), label="value_strides")
    for name, mode in (("key", kmode), ("value", vmode)):
        if mode == "last2" and n > 0:
            expect.bad(f"{name} last stride 2", {name, "key"})
        if mode == "reversed" and n > 1:
            expect.either(f"{name} negative token stride")
    if kmode == "bcast":
        kvals[:] = kvals[:1]
    if vmode == "bcast":
        vvals[:] = vvals[:1]
    # dtype-exact fp32 values
    k32 = decode(encode(kvals, dtype), dtype).reshape(kvals.shape)
    v32 = decode(encode(vvals, dtype), dtype).reshape(vvals.shape)
    kbuf, key = place_tokens(env, rng, k32, dtype, kmode)
    vdt = dtype
    dd = d(st.sampled_from(("ok",) * 10 + ("key_f64", "both_i32", "mismatch", "v_tokens")),
           label="dtype_defect")
    if dd == "key_f64":
        kbuf, key = place_tokens(env, rng, k32, "float64", "contiguous")
        expect.bad("key float64", {"key", "value"}, (TypeError,))
    elif dd == "both_i32":
        kbuf, key = place_tokens(env, rng, np.zeros_like(k32), "int32", "contiguous")
        vdt = "int32"
        expect.bad("key/value int32", {"key", "value"}, (TypeError,))
    elif dd == "mismatch":
        vdt = "float16" if dtype != "float16" else "float32"
        expect.bad("value dtype != key dtype", {"value", "key"}, (TypeError,))
    v_rows = n
    if dd == "v_tokens":
        # value with one row fewer than key: a defect unless slot_mapping is cut to n - 1 below.
        # (It was one row more, expected to raise; but rows past the slots are padding, valid by
        # the contract: found by a seeded long run, where that draw came without another defect.)
        # With no tokens, one row more: padding, valid. Contiguous, so no stride defect drawn
        # above for value stays.
        vmode = "contiguous"
        expect.defects = [x for x in expect.defects if x[0] != "value last stride 2"]
        expect.open = [x for x in expect.open if x != "value negative token stride"]
        v_rows = n - 1 if n else 1
        vvals = vvals[:v_rows] if n else np.zeros((1, kh, vd), np.float32)
    if vdt == "int32":
        vbuf, value = place_tokens(env, rng, np.zeros_like(vvals), vdt, "contiguous")
    else:
        vbuf, value = place_tokens(env, rng, decode(encode(vvals, vdt), vdt).reshape(vvals.shape),
                                   vdt, vmode)
    bufs += [kbuf, vbuf]

    # slot_mapping
    NT = N * T
    sdt = d(st.sampled_from(("int64", "int32", "int64", "int16", "float32", "list")), label="slot_dtype")
    perm = list(rng.permutation(NT)) if NT else []
    slots = []
    for i in range(n):
        kind = d(st.sampled_from(("valid",) * 5 + ("pad", "neg", "oob", "huge", "dup")), label="slot")
        if kind == "valid" and perm:
            slots.append(int(perm.pop()))
        elif kind == "pad" or (kind == "valid" and not perm):
            slots.append(-1)
        elif kind == "neg":
            slots.append(-(2**31))
        elif kind == "oob":
            slots.append(NT + int(rng.integers(0, 5)))
        elif kind == "huge":
            slots.append(2**31 - 1 if sdt != "int64" else 2**40 + 3)
        else:
            slots.append(slots[-1] if slots and not gpu else -1)
    slot_len = n
    sl = d(st.sampled_from(("ok",) * 8 + ("short", "long", "2d")), label="slot_shape")
    if sl == "short" and n > 0:  # padded key/value rows (CUDA graphs): the first n - 1 are stored
        slots, slot_len = slots[:-1], n - 1
    elif sl == "long":
        slots, slot_len = slots + [-1], n + 1
        expect.bad("slot_mapping too long", {"slot_mapping"})
    if v_rows < slot_len:
        expect.bad("value token count", {"value", "key", "slot_mapping"})
    slayout = d(st.sampled_from(("contiguous", "contiguous", "strided") +
                                (("reversed",) if env.backend == "numpy" else ())), label="slot_layout")
    if slayout == "reversed" and len(slots) > 1:
        expect.either("slot_mapping negative stride")
    if sdt == "list":
        slot_obj, sbufs = list(slots), []
        expect.bad("slot_mapping a list", {"slot_mapping"}, (TypeError,))
    else:
        if sdt in ("int16", "float32"):
            expect.bad(f"slot_mapping {sdt}", {"slot_mapping"}, (TypeError,))
            vals = np.asarray(slots, np.int64).clip(-30000, 30000)
        else:
            vals = np.asarray(slots, np.int64)
        arr = vals.reshape(1, -1) if sl == "2d" else vals
        if sl == "2d":
            expect.bad("slot_mapping 2-D", {"slot_mapping"})
        sb, slot_obj = env.array(arr.astype(sdt), sdt, rng, slayout if arr.ndim == 1 else "contiguous")
        sbufs = [sb]
    bufs += sbufs

    ks, ksv, kb = draw_scale(data, "k_scale", env, rng, expect, gpu)
    vs, vsv, vb = draw_scale(data, "v_scale", env, rng, expect, gpu)
    bufs += kb + vb
    recipe = d(st.sampled_from(("nvfp4", "nvfp4_4over6", "nvfp4", "nvfp4_4over6", "NVFP4")),
               label="recipe")
    if recipe == "NVFP4":
        expect.bad("recipe unknown", {"recipe"})
    scale_layout = draw_scale_layout(data, expect)
    check_profile(expect, cache, scale_layout)

    # deliberate overlaps and device mix-ups
    ov = d(st.sampled_from(("none",) * 6 + ("key_in_cache", "slots_in_cache", "meta_key", "meta_slots")),
           label="overlap")
    isz = ITEMSIZE.get(dtype, 4)
    if ov == "key_in_cache" and N > 0 and n > 0 and n * kh * kd * isz <= N * cache.k_ps - cache.k_off \
            and dd == "ok" and cache.form != "apart":
        key = cache.k_buf.view(dtype, (n, kh, kd), (kh * kd, kd, 1), cache.k_off // isz) \
            if cache.k_off % isz == 0 else key
        if cache.k_off % isz == 0:
            expect.bad("key overlaps the cache", {"key", "kv_cache", "key_cache", "value_cache"})
    elif ov == "slots_in_cache" and N > 0 and len(slots) > 0 and sdt == "int64" and sl != "2d" \
            and len(slots) * 8 <= N * cache.k_ps - cache.k_off and cache.k_off % 8 == 0:
        slot_obj = cache.k_buf.view("int64", (len(slots),), (1,), cache.k_off // 8)
        expect.bad("slot_mapping overlaps the cache", {"slot_mapping", "kv_cache", "key_cache", "value_cache"})
    elif ov in ("meta_key", "meta_slots") and env.backend == "torch" and not gpu:
        if ov == "meta_key":
            key = torch.empty(tuple(key.shape), dtype=key.dtype, device="meta")
            expect.bad("key on meta", {"key"}, (TypeError, ValueError))
        elif sdt not in ("list",):
            slot_obj = torch.empty(tuple(slot_obj.shape), dtype=slot_obj.dtype, device="meta")
            expect.bad("slot_mapping on meta", {"slot_mapping"}, (TypeError, ValueError))

    params = dict(geo, n=n, dtype=dtype, kmode=kmode, vmode=vmode, slots=slots, sdt=sdt,
                  slayout=slayout, recipe=recipe, scale_layout=scale_layout, ks=ks, vs=vs,
                  defects=[x[0] for x in expect.defects], open=expect.open)

    def call():
        return nvfp4kv.store(key, value, slot_mapping=slot_obj, k_scale=ks, v_scale=vs, recipe=recipe,
                             scale_layout=scale_layout, **kw)

    def expected(before):
        m = len(slots)  # padding rows past slot_mapping's length are not stored
        return ref_store(cache, before, k32[:m], v32[:m], slots, ksv, vsv, recipe, scale_layout)

    return call, expect, bufs, params, expected, cache


def check_store(env, data):
    call, expect, bufs, params, expected, cache = draw_store(data, env)
    ok, _, before = run_call(call, expect, bufs, params, STORE_NAMES)
    if not ok:
        return
    want = expected(before)
    for b in bufs:
        now = b.snapshot()
        if not np.array_equal(now, want[id(b)]):
            bad = np.nonzero(now != want[id(b)])[0]
            raise AssertionError(f"store: {bad.size} bytes differ from the reference (buffer of "
                                 f"{b.size}, body at {b.pre}); first offsets {bad[:8].tolist()}: "
                                 f"got {now[bad[:8]]} want {want[id(b)][bad[:8]]}\nparams: {params}")


# -------------------------------------------------------------------------------- dequantize
DEQ_NAMES = {"kv_cache", "key_cache", "value_cache", "pages", "k_scale", "v_scale", "dtype",
             "scale_layout", "key_out", "value_out", "stream"}
GATHER_NAMES = {"kv_cache", "key_cache", "value_cache", "block_table", "seq_lens", "cu_seqlens",
                "k_scale", "v_scale", "dtype", "scale_layout", "key_out", "value_out", "stream"}


def draw_outputs(data, env, rng, expect, lead, D, Dv, dtype, others, label):
    """key_out/value_out of shape lead+(D,) / lead+(Dv,) in guarded poison buffers, with stride
    modes and defects. Returns (ko, vo, [(Buf, shape, strides, base) for k, v], bufs)."""
    d = data.draw
    outs, views = [], []
    rank = len(lead) + 1
    for which, Dx in (("key_out", D), ("value_out", Dv)):
        mode = d(st.sampled_from(("contiguous", "contiguous", "padded", "permuted")), label=f"{which}_mode")
        shape = tuple(lead) + (Dx,)
        isz = ITEMSIZE[dtype]
        if mode == "padded":  # each dimension's stride the padded size of the next
            strides = [1] * rank
            acc = Dx + 8
            for i in range(rank - 2, -1, -1):
                strides[i] = acc
                acc = acc * shape[i] + 4
            strides, extent, base = tuple(strides), acc + 8, 4
        elif mode == "permuted" and rank >= 3:
            # physical order: dim 1 outermost, then dim 0, then the rest
            inner = int(np.prod(shape[2:], dtype=np.int64))
            strides = (inner, shape[0] * inner) + tuple(
                int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(2, rank))
            extent, base = int(np.prod(shape, dtype=np.int64)), 0
        else:
            strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(rank))
            extent, base = int(np.prod(shape, dtype=np.int64)), 0
        buf = Buf(env, rng, (extent + 16) * 4)  # room for the widest dtype a defect uses
        outs.append(buf)
        views.append([buf, shape, strides, base])
    defect = d(st.sampled_from(("none",) * 8 + ("shape", "dtype_int", "dtype_mismatch", "last2",
                                               "same", "expand", "in_cache", "in_other")),
               label=f"{label}_out_defect")
    odt = [dtype, dtype]
    both = {"key_out", "value_out"}
    if defect == "shape":
        v = views[0]
        v[1] = v[1][:-1] + (v[1][-1] + 16,) if d(st.booleans()) else (v[1][0] + 1,) + v[1][1:]
        v[3] = 0
        v[2] = tuple(int(np.prod(v[1][i + 1:], dtype=np.int64)) for i in range(rank))
        outs[0] = Buf(env, rng, (int(np.prod(v[1], dtype=np.int64)) + 16) * ITEMSIZE[dtype])
        v[0] = outs[0]
        expect.bad("key_out shape", both | {"kv_cache", "key_cache"})
    elif defect == "dtype_int":
        odt = ["int32", "int32"]
        expect.bad("outputs int32", both, (TypeError,))
    elif defect == "dtype_mismatch":
        odt[1] = "float32" if dtype != "float32" else "float16"
        expect.bad("value_out dtype", both, (TypeError,))
    elif defect == "last2":
        v = views[1]
        if int(np.prod(v[1], dtype=np.int64)) > 0:
            v[2] = tuple(2 * int(np.prod(v[1][i + 1:], dtype=np.int64)) for i in range(rank))
            v[3] = 0
            outs[1] = Buf(env, rng, (2 * int(np.prod(v[1], dtype=np.int64)) + 16) * ITEMSIZE[dtype])
            v[0] = outs[1]
            expect.bad("value_out last stride 2", both)
    elif defect == "same" and D == Dv:
        if int(np.prod(views[0][1], dtype=np.int64)) > 0:
            views[1] = list(views[0])
            expect.bad("key_out is value_out", both)
    elif defect == "expand":
        v = views[0]
        if v[1][0] > 1 and int(np.prod(v[1], dtype=np.int64)) > 0:
            v[2] = (0,) + tuple(v[2][1:])
            expect.bad("key_out self-overlapping", both)
    elif defect in ("in_cache", "in_other") and others:
        pick = 0 if defect == "in_cache" or len(others) == 1 else \
            d(st.integers(1, len(others) - 1), label="overlapped input")
        target_buf, target_names, active = others[pick]
        v = views[0]
        isz = ITEMSIZE[dtype]
        n_el = int(np.prod(v[1], dtype=np.int64))
        if active and 0 < n_el * isz <= target_buf.size - target_buf.pre - 16:
            # contiguous, from the start of the target's body: overlaps it if its body is used
            v[0], v[2], v[3] = target_buf, tuple(int(np.prod(v[1][i + 1:], dtype=np.int64))
                                                 for i in range(rank)), 0
            expect.bad(f"key_out overlaps {sorted(target_names)}", both | target_names)
    objs = []
    for (buf, shape, strides, base), dt in zip(views, odt):
        objs.append(buf.view(dt, shape, strides, base))
    uniq = []
    for b in outs + [v[0] for v in views]:
        if all(b is not u for u in uniq):
            uniq.append(b)
    return objs[0], objs[1], views, uniq


def draw_dtype_arg(data, env, expect):
    """dtype= when outputs are allocated by the call: (argument, resulting dtype name)."""
    opts = ["float32", "float16", "bfloat16", "np.float16", "torch.bfloat16", "int8", "float64"]
    name = data.draw(st.sampled_from(opts), label="dtype_arg")
    if name == "np.float16":
        return np.float16, "float16"
    if name == "torch.bfloat16":
        if env.backend == "numpy":
            expect.bad("torch dtype for numpy", {"dtype"})
        return torch.bfloat16, "bfloat16"
    if name in ("int8", "float64"):
        expect.bad(f"dtype {name}", {"dtype"})
    if name == "bfloat16" and env.backend == "numpy":
        expect.bad("bfloat16 with numpy", {"dtype"})
    return name, name


def out_check(buf_info, snaps_now, before, expected_rows, dtype, what):
    """expected_rows: list of (index tuple prefix (ints), fp32 values of the sub-block)."""
    buf, shape, strides, base = buf_info
    offs = elem_offsets(shape, strides, base)
    written = []
    for idx, vals in expected_rows:
        o = offs[idx]
        assert_floats_at(snaps_now[id(buf)], buf, dtype, o, vals, f"{what}[{idx}]")
        written.append(written_mask_bytes(buf, dtype, o))
    written = np.concatenate(written) if written else np.zeros(0, np.int64)
    assert_rest_unchanged(buf, before[id(buf)], snaps_now[id(buf)], written, what)


def returned_check(arr, dtype, want32, what):
    got = arr if isinstance(arr, np.ndarray) else arr.detach().cpu()
    if not isinstance(got, np.ndarray):
        got = got.view(torch.int16 if dtype != "float32" else torch.int32).numpy()
    got_bits = np.ascontiguousarray(got).view(_UINT[ITEMSIZE[dtype]]).reshape(-1)
    want = encode(np.asarray(want32, np.float32).reshape(-1), dtype).reshape(-1)
    wnan, gnan = is_nan_bits(want, dtype), is_nan_bits(got_bits, dtype)
    bad = np.where(wnan, ~gnan, got_bits != want)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ; first {np.nonzero(bad)[0][:6]}"


def draw_dequantize(data, env, gpu=False):
    d = data.draw
    expect = Expect()
    rng = np.random.default_rng(d(st.integers(0, 2**32 - 1), label="seed"))
    geo = draw_geometry(data, env.backend, gpu)
    cache, kw = draw_cache(data, env, rng, expect, geo, None, for_write=False)
    N, T, H, D, Dv = cache.N, cache.T, cache.H, cache.D, cache.Dv
    bufs = list(cache.bufs)
    ks, ksv, kb = draw_scale(data, "k_scale", env, rng, expect, gpu)
    vs, vsv, vb = draw_scale(data, "v_scale", env, rng, expect, gpu)
    bufs += kb + vb
    scale_layout = draw_scale_layout(data, expect)
    check_profile(expect, cache, scale_layout)
    # pages
    pk = d(st.sampled_from(("none", "none", "int64", "int32", "float32", "2d")), label="pages")
    pages, page_obj = None, None
    if pk != "none":
        P = d(st.integers(0, 5), label="P")
        pages = [int(rng.choice([0, 1, 2, -1, N, 10**6, -(2**31)])) if rng.random() < 0.3
                 else int(rng.integers(0, max(N, 1))) for _ in range(P)]
        dt = "int64" if pk in ("int64", "2d") else pk
        if pk == "float32":
            expect.bad("pages float32", {"pages"}, (TypeError,))
        if pk == "2d":
            expect.bad("pages 2-D", {"pages"})
        arr = np.asarray(pages, np.int64).clip(-(2**31), 2**31 - 1)
        arr = arr.reshape(1, -1) if pk == "2d" else arr
        lay = d(st.sampled_from(("contiguous", "strided"))) if arr.ndim == 1 else "contiguous"
        pb, page_obj = env.array(arr.astype(dt), dt, rng, lay)
        bufs.append(pb)
    # (CUDA variant: pages into allocated outputs leave the other pages uninitialized)
    give_out = d(st.booleans(), label="key_out/value_out given") or (gpu and pk != "none")
    out_views = None
    if give_out:
        dtypes = ("float32", "float16") + (("bfloat16",) if env.backend == "torch" else ())
        odt = d(st.sampled_from(dtypes), label="out_dtype")
        others = [(cache.k_buf, {"kv_cache", "key_cache", "value_cache"}, N > 0)]
        if pk not in ("none",):
            others.append((bufs[-1], {"pages"}, len(pages) > 0))
        ko, vo, out_views, obufs = draw_outputs(data, env, rng, expect, (N, T, H), D, Dv, odt,
                                                others, "deq")
        bufs += [b for b in obufs if all(b is not x for x in bufs)]
        dtype_arg = None
    else:
        ko = vo = None
        dtype_arg, odt = draw_dtype_arg(data, env, expect)
    params = dict(geo, scale_layout=scale_layout, pages=pages, pk=pk, give_out=give_out,
                  odt=odt, ks=ks, vs=vs, defects=[x[0] for x in expect.defects], open=expect.open)
    extra = {} if dtype_arg is None else {"dtype": dtype_arg}

    def call():
        return nvfp4kv.dequantize(k_scale=ks, v_scale=vs, pages=page_obj, scale_layout=scale_layout,
                                  key_out=ko, value_out=vo, **extra, **kw)

    def check(result, before):
        now = snapshot_all(bufs)
        # the cache and every input unchanged
        for b in bufs:
            if out_views is None or all(b is not v[0] for v in out_views):
                assert np.array_equal(now[id(b)], before[id(b)]), f"dequantize wrote an input {params}"
        kref, vref = ref_dequant(cache, before, ksv, vsv, scale_layout)
        todo = range(N) if pages is None else sorted({p for p in pages if 0 <= p < N})
        if out_views is not None:
            assert result[0] is ko and result[1] is vo
            out_check(out_views[0], now, before, [((p,), kref[p]) for p in todo], odt, "key_out")
            out_check(out_views[1], now, before, [((p,), vref[p]) for p in todo], odt, "value_out")
        else:
            k, v = result
            assert tuple(k.shape) == (N, T, H, D) and tuple(v.shape) == (N, T, H, Dv)
            todo = list(todo)
            returned_check(k[todo], odt, kref[todo], "key")
            returned_check(v[todo], odt, vref[todo], "value")

    return call, expect, bufs, params, check


def check_dequantize(env, data):
    call, expect, bufs, params, check = draw_dequantize(data, env)
    ok, result, before = run_call(call, expect, bufs, params, DEQ_NAMES)
    if ok:
        check(result, before)


# ------------------------------------------------------------------------------------ gather
def draw_gather(data, env, gpu=False):
    d = data.draw
    expect = Expect()
    rng = np.random.default_rng(d(st.integers(0, 2**32 - 1), label="seed"))
    geo = draw_geometry(data, env.backend, gpu)
    cache, kw = draw_cache(data, env, rng, expect, geo, None, for_write=False)
    N, T, H, D, Dv = cache.N, cache.T, cache.H, cache.D, cache.Dv
    bufs = list(cache.bufs)
    ks, ksv, kb = draw_scale(data, "k_scale", env, rng, expect, gpu)
    vs, vsv, vb = draw_scale(data, "v_scale", env, rng, expect, gpu)
    bufs += kb + vb
    scale_layout = draw_scale_layout(data, expect)
    check_profile(expect, cache, scale_layout)

    B = d(st.integers(0, 4), label="B")
    mb = d(st.integers(0, 3), label="max_blocks")
    idx = d(st.sampled_from(("int32", "int64")), label="idx")
    big = 2**31 - 1 if idx == "int32" else 2**62
    bt = np.array([[int(rng.choice([-1, N, big, -big])) if rng.random() < 0.2
                    else int(rng.integers(0, max(N, 1))) for _ in range(mb)] for _ in range(B)],
                  np.int64).reshape(B, mb)
    sl_kind = d(st.sampled_from(("normal", "normal", "zero", "past_table", "negative", "huge")), label="seq_lens")
    seq = rng.integers(0, mb * T + 1, B) if sl_kind == "normal" else \
        np.zeros(B, np.int64) if sl_kind == "zero" else \
        rng.integers(mb * T, (mb + 2) * T + 1, B) if sl_kind == "past_table" else \
        rng.integers(-5, 3, B) if sl_kind == "negative" else \
        np.where(rng.random(B) < 0.5, big, rng.integers(0, 2 * T + 1, B))
    seq = np.asarray(seq, np.int64)
    if gpu:
        # The row ranges below are the lengths clamped at 64 (prefix): a longer sequence would
        # also write the next one's rows, whose values the CUDA path leaves to whichever block
        # writes last, element by element (found on the H100, in whole-suite runs only: a torn row).
        # The last sequence may stay long: its rows end at the total.
        seq[:-1] = np.minimum(seq[:-1], 64)
    cu_kind = d(st.sampled_from(("default", "prefix", "gaps", "overlap", "negative", "huge")),
                label="cu_seqlens")
    prefix = np.concatenate([[0], np.cumsum(np.minimum(np.maximum(seq, 0), 64))]).astype(np.int64)
    if cu_kind in ("default", "prefix"):
        cu = prefix
    elif cu_kind == "gaps":
        cu = prefix + np.cumsum(rng.integers(0, 3, B + 1))
    elif cu_kind == "overlap":
        cu = np.sort(rng.integers(0, max(int(prefix[-1]), 1), B + 1)) if not gpu else prefix
        if B > 1 and not gpu:
            cu[1:-1] = rng.integers(0, max(int(prefix[-1]), 1), B - 1)
    elif cu_kind == "negative":
        cu = prefix - int(rng.integers(1, 6))
    else:
        cu = np.where(rng.random(B + 1) < 0.4, big - 3, prefix)
    cu = np.asarray(cu, np.int64)
    if cu_kind == "default" and sl_kind == "huge":
        seq = np.minimum(seq, 64)  # default prefix sums of huge lengths overflow int32 / memory
    # defects of the index arguments
    ix = d(st.sampled_from(("ok",) * 8 + ("bt_float", "bt_rank1", "sl_len", "cu_len", "sl_dtype",
                                         "cu_i16", "bt_meta")), label="index_defect")
    bt_dt, sl_dt, cu_dt = idx, d(st.sampled_from(("int32", "int64")), label="sl_dt"), \
        d(st.sampled_from(("int32", "int64")), label="cu_dt")
    if sl_kind == "huge" and sl_dt == "int32":
        seq = np.minimum(seq, 2**31 - 1)
    if cu_kind == "huge" and cu_dt == "int32":
        cu = np.minimum(cu, 2**31 - 1)
    bt_shape_arr, seq_arr, cu_arr = bt, seq, cu
    if ix == "bt_float":
        bt_dt = "float32"
        expect.bad("block_table float32", {"block_table"}, (TypeError,))
    elif ix == "bt_rank1":
        bt_shape_arr = bt.reshape(-1)
        expect.bad("block_table rank 1", {"block_table"})
    elif ix == "sl_len":
        seq_arr = np.concatenate([seq, [1]])
        expect.bad("seq_lens length", {"seq_lens"})
    elif ix == "cu_len" and cu_kind != "default":
        cu_arr = cu[:-1]
        expect.bad("cu_seqlens length", {"cu_seqlens"})
    elif ix == "sl_dtype":
        sl_dt = "float32"
        expect.bad("seq_lens float32", {"seq_lens"}, (TypeError,))
    elif ix == "cu_i16" and cu_kind != "default":
        cu_dt = "int16"
        cu_arr = cu.clip(-30000, 30000)
        expect.bad("cu_seqlens int16", {"cu_seqlens"}, (TypeError,))
    bt_lay = d(st.sampled_from(("contiguous", "strided")), label="bt_layout")
    btb, bt_obj = env.array(bt_shape_arr.astype(bt_dt), bt_dt, rng, bt_lay)
    slb, sl_obj = env.array(np.asarray(seq_arr).astype(sl_dt), sl_dt, rng)
    bufs += [btb, slb]
    cu_obj = None
    if cu_kind != "default":
        cub, cu_obj = env.array(np.asarray(cu_arr).astype(cu_dt), cu_dt, rng)
        bufs.append(cub)
    if ix == "bt_meta" and env.backend == "torch" and not gpu:
        bt_obj = torch.empty(tuple(bt_obj.shape), dtype=bt_obj.dtype, device="meta")
        expect.bad("block_table on meta", {"block_table"}, (TypeError, ValueError))

    give_out = d(st.booleans(), label="outputs given") or cu_kind in ("huge",) or \
        (cu_kind == "default" and sl_kind == "huge")
    out_views = None
    if give_out:
        total = d(st.integers(0, 40), label="total")
        dtypes = ("float32", "float16") + (("bfloat16",) if env.backend == "torch" else ())
        odt = d(st.sampled_from(dtypes), label="out_dtype")
        others = [(cache.k_buf, {"kv_cache", "key_cache", "value_cache"}, N > 0),
                  (btb, {"block_table"}, bt.size > 0 and ix not in ("bt_meta", "bt_rank1")),
                  (slb, {"seq_lens"}, len(seq_arr) > 0)]
        ko, vo, out_views, obufs = draw_outputs(data, env, rng, expect, (total, H), D, Dv, odt,
                                                others, "gather")
        bufs += [b for b in obufs if all(b is not x for x in bufs)]
        dtype_arg = None
    else:
        ko = vo = None
        if d(st.booleans(), label="dtype default"):
            dtype_arg, odt = None, ("bfloat16" if env.backend == "torch" else "float32")
        else:
            dtype_arg, odt = draw_dtype_arg(data, env, expect)
        if cu_kind == "default":
            total = int(np.sum(np.maximum(np.asarray(seq_arr), 0)))
            if len(seq_arr) and np.min(seq_arr) < 0:
                # The call reads the lengths on the host to size its outputs, and refuses a
                # negative one there (api._total_rows; found by a seeded long run: a valid call
                # was expected where the lengths summed to >= 0).
                expect.bad("negative seq_lens, outputs allocated", {"seq_lens"})
        else:
            total = int(cu_arr[-1]) if len(cu_arr) else 0
            # Two findings of this test, fixed (test_gather_empty_cu_seqlens_without_outputs and
            # test_gather_negative_total_without_outputs below): an empty cu_seqlens, or a last
            # entry below 0, sizes no outputs, and the call says so naming cu_seqlens.
            if len(cu_arr) == 0:
                expect.bad("empty cu_seqlens, outputs allocated by the call", {"cu_seqlens"})
            elif total < 0:
                expect.bad("negative cu_seqlens[-1], outputs allocated", {"cu_seqlens"})
    params = dict(geo, scale_layout=scale_layout, B=B, mb=mb, bt=bt.tolist(), seq=seq.tolist(),
                  cu=cu.tolist(), cu_kind=cu_kind, sl_kind=sl_kind, idx=(bt_dt, sl_dt, cu_dt),
                  give_out=give_out, total=total, odt=odt, ks=ks, vs=vs,
                  defects=[x[0] for x in expect.defects], open=expect.open)
    extra = {} if dtype_arg is None else {"dtype": dtype_arg}

    def call():
        return nvfp4kv.gather_dequant(kv_cache=kw["kv_cache"], value_cache=kw.get("value_cache"),
                                      block_table=bt_obj, seq_lens=sl_obj, cu_seqlens=cu_obj,
                                      k_scale=ks, v_scale=vs, scale_layout=scale_layout,
                                      key_out=ko, value_out=vo, **extra)

    def expected_rows(before, total):
        """{row: (k (H,D), v (H,Dv))}, later sequences winning (the CPU path's order)."""
        kref, vref = ref_dequant(cache, before, ksv, vsv, scale_layout)
        rows = {}
        cu_use = cu if cu_kind != "default" else np.concatenate([[0], np.cumsum(np.maximum(seq, 0))])
        for b in range(B):
            start, n = int(cu_use[b]), max(int(seq[b]), 0)
            lo, hi = max(0, -start), min(n, total - start)
            for j in range(lo, max(lo, hi)):
                blk = j // T
                page = int(bt[b, blk]) if blk < mb else -1
                if 0 <= page < N:
                    rows[start + j] = (kref[page, j % T], vref[page, j % T])
                else:
                    rows[start + j] = (np.zeros((H, D), np.float32), np.zeros((H, Dv), np.float32))
        return rows

    def check(result, before):
        now = snapshot_all(bufs)
        for b in bufs:
            if out_views is None or all(b is not v[0] for v in out_views):
                assert np.array_equal(now[id(b)], before[id(b)]), f"gather wrote an input {params}"
        if out_views is not None:
            assert result[0] is ko and result[1] is vo
            rows = expected_rows(before, total)
            out_check(out_views[0], now, before, [((r,), kv[0]) for r, kv in rows.items()], odt, "key_out")
            out_check(out_views[1], now, before, [((r,), kv[1]) for r, kv in rows.items()], odt, "value_out")
        else:
            k, v, cu_out = result
            assert tuple(k.shape) == (total, H, D) and tuple(v.shape) == (total, H, Dv), (k.shape, total)
            rows = expected_rows(before, total)
            got_rows = sorted(rows)
            if got_rows:
                returned_check(k[got_rows], odt, np.stack([rows[r][0] for r in got_rows]), "key")
                returned_check(v[got_rows], odt, np.stack([rows[r][1] for r in got_rows]), "value")
            if cu_kind == "default":
                got_cu = cu_out if isinstance(cu_out, np.ndarray) else cu_out.cpu().numpy()
                assert got_cu.tolist() == np.concatenate([[0], np.cumsum(seq)]).tolist()

    return call, expect, bufs, params, check


def check_gather(env, data):
    call, expect, bufs, params, check = draw_gather(data, env)
    ok, result, before = run_call(call, expect, bufs, params, GATHER_NAMES)
    if ok:
        check(result, before)


# ------------------------------------------------------------------------------- CUDA variant
class Replay:
    """Records the draws of a first pass and replays them in a second one, so that one drawn
    case is built twice: on the CPU and on CUDA (every byte from the same seeded generator)."""

    def __init__(self, data):
        self.data, self.log, self.pos = data, [], None

    def draw(self, strategy, label=None):
        if self.pos is None:
            value = self.data.draw(strategy, label=label)
            self.log.append(value)
            return value
        value = self.log[self.pos]
        self.pos += 1
        return value

    def replay(self):
        self.pos = 0
        return self


def _outcome(call, bufs):
    try:
        result = call()
        if HAS_CUDA:
            torch.cuda.synchronize()
        return None, result
    except Exception as e:  # noqa: BLE001 - compared between the two devices
        return e, None


def _bits(x):
    x = x.detach().cpu()
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).numpy()


def check_cuda_against_cpu(kind, data):
    """The same drawn call (torch tensors) on the CPU and on CUDA: the same exception type and
    argument named, or every byte of every buffer (and of allocated outputs) identical. Draws
    the CUDA path does not pin down are left out (gpu=True): duplicate slots, overlapping output
    rows, meta tensors, device scale tensors."""
    rec = Replay(data)
    draw = {"store": draw_store, "dequantize": draw_dequantize, "gather": draw_gather}[kind]
    cpu_case = draw(rec, Env("torch", "cpu"), gpu=True)
    gpu_case = draw(rec.replay(), Env("torch", "cuda"), gpu=True)
    (cpu_call, _, cpu_bufs, params), (gpu_call, _, gpu_bufs, _) = cpu_case[:4], gpu_case[:4]
    assert len(cpu_bufs) == len(gpu_bufs)
    for a, b in zip(cpu_bufs, gpu_bufs):
        assert np.array_equal(a.snapshot(), b.snapshot()), "the two builds differ"
    ce, cr = _outcome(cpu_call, cpu_bufs)
    ge, gr = _outcome(gpu_call, gpu_bufs)
    if ce is not None or ge is not None:
        assert type(ce) is type(ge), f"CPU: {ce!r}, CUDA: {ge!r}; params {params}"
        assert named_argument(str(ce)) == named_argument(str(ge)), f"CPU: {ce!r}, CUDA: {ge!r}"
    for a, b in zip(cpu_bufs, gpu_bufs):
        sa, sb = a.snapshot(), b.snapshot()
        if not np.array_equal(sa, sb):
            bad = np.nonzero(sa != sb)[0]
            raise AssertionError(f"{kind}: {bad.size} bytes differ CPU vs CUDA (buffer of {a.size}, "
                                 f"body at {a.pre}); first {bad[:8].tolist()}\nparams: {params}")
    if ce is None and cr is not None:
        for x, y in zip(cr, gr):
            if x is not None and y is not None and hasattr(x, "shape"):
                assert np.array_equal(_bits(x), _bits(y)), f"{kind}: returned arrays differ"


@needs_cuda
@budget("cuda")
@given(data=st.data())
def test_cuda_store_property(data):
    check_cuda_against_cpu("store", data)


@needs_cuda
@budget("cuda")
@given(data=st.data())
def test_cuda_dequantize_property(data):
    check_cuda_against_cpu("dequantize", data)


@needs_cuda
@budget("cuda")
@given(data=st.data())
def test_cuda_gather_dequant_property(data):
    check_cuda_against_cpu("gather", data)


@budget("gather")
@given(data=st.data())
def test_cuda_gather_draws_give_each_row_to_one_sequence(data):
    """The CUDA variant above holds every returned byte to the CPU path's, so its draws must not
    let two sequences write one row: the CPU path gives it the later sequence's values, the GPU
    either one's, element by element. Found on the H100, where that test failed in whole-suite
    runs only (a row partly one sequence's, partly the other's): a long sequence's rows ran into the
    next one's, whose start the drawn cu_seqlens placed after at most 64 of them. Checked here, on
    the CPU, for the draws the CUDA variant makes."""
    params = draw_gather(data, Env("torch", "cpu"), gpu=True)[3]
    seq = [max(int(n), 0) for n in params["seq"]]
    cu = params["cu"] if params["cu_kind"] != "default" else np.cumsum([0] + seq).tolist()
    owner = {}
    for b, n in enumerate(seq):
        for r in range(max(int(cu[b]), 0), min(int(cu[b]) + n, params["total"])):
            assert r not in owner, f"row {r}: sequences {owner[r]} and {b}; {params}"
            owner[r] = b


# ------------------------------------------------------------------------------------- tests
BACKEND = st.sampled_from(("numpy", "torch"))


@budget("store")
@given(data=st.data())
def test_store_property(data):
    check_store(Env(data.draw(BACKEND, label="backend")), data)


@budget("dequantize")
@given(data=st.data())
def test_dequantize_property(data):
    check_dequantize(Env(data.draw(BACKEND, label="backend")), data)


@budget("gather")
@given(data=st.data())
def test_gather_dequant_property(data):
    check_gather(Env(data.draw(BACKEND, label="backend")), data)


def test_sides_of_different_head_sizes_in_one_allocation():
    """Found by test_dequantize_property: a cache given as two sides carved from ONE allocation,
    pages [K side | V side] with K head size 16 and V head size 64, shares no byte between the
    sides, yet store/dequantize reject it ('value_cache: shares memory with key_cache'): the
    overlap test fell back to byte ranges for views of different shapes. Fixed: the sides compare
    page by page (cache.cpp sides_overlap)."""
    N, T, H, D, Dv = 2, 1, 2, 16, 64
    F, Fv = 9 * D // 16, 9 * Dv // 16
    ps = H * T * (F + Fv)
    raw = np.zeros(N * ps, np.uint8)
    k = np.lib.stride_tricks.as_strided(raw, (N, T, H, F), (ps, F, T * F, 1))
    v = np.lib.stride_tricks.as_strided(raw[H * T * F:], (N, T, H, Fv), (ps, Fv, T * Fv, 1))
    assert not np.shares_memory(k, v)
    nvfp4kv.dequantize(k, 1.0, 1.0, value_cache=v, scale_layout="linear")


def test_gather_empty_cu_seqlens_without_outputs():
    """Found by test_gather_dequant_property: B = 0 (block_table (0, 0), seq_lens []), an explicit
    cu_seqlens of length 0 (it must have B + 1 = 1 entries) and no key_out/value_out: the call
    raises IndexError (api.py, `int(cu_seqlens[-1])`) instead of a ValueError naming
    cu_seqlens. Fixed: a ValueError naming cu_seqlens."""
    cache = np.zeros((1, 2, 4, 1, 9), np.uint8)
    with pytest.raises(ValueError) as e:
        nvfp4kv.gather_dequant(cache, np.zeros((0, 0), np.int32), np.zeros(0, np.int32),
                               cu_seqlens=np.zeros(0, np.int32), scale_layout="linear")
    assert named_argument(str(e.value)) == "cu_seqlens", e.value


@pytest.mark.parametrize("backend", ("numpy", "torch"))
def test_gather_negative_total_without_outputs(backend):
    """Found by test_gather_dequant_property: B = 1, seq_lens [-3] (default cu_seqlens, so
    cu_seqlens[-1] = -3) or an explicit cu_seqlens ending below 0, no key_out/value_out: numpy
    raises ValueError('negative dimensions are not allowed'), naming no argument; torch raises
    RuntimeError('Trying to create tensor with negative dimension -3: [-3, 1, 16]'). Expected:
    a ValueError naming seq_lens or cu_seqlens. Fixed."""
    f = (lambda a: a) if backend == "numpy" else torch.from_numpy
    cache = f(np.zeros((1, 2, 4, 1, 9), np.uint8))
    with pytest.raises(ValueError) as info:
        nvfp4kv.gather_dequant(cache, f(np.zeros((1, 1), np.int32)), f(np.array([-3], np.int32)),
                               scale_layout="linear")
    assert named_argument(str(info.value)) in ("seq_lens", "cu_seqlens"), info.value
