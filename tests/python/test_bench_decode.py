"""benchmarks/bench_decode.py without a GPU: which cases a command line runs, the byte model behind
"% copy", and the variants table's rows (the timing itself runs on the device)."""
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_decode.py")


@pytest.fixture(scope="module")
def bd():
    if not os.path.isfile(SCRIPT):
        pytest.skip("benchmarks/ is not next to these tests (a copy of tests/python only)")
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports no torch: parsing and the byte model need none
    return mod


def test_default_runs_every_case_and_variant(bd):
    a = bd.parse_args([])
    assert [(s.B, s.L) for s in a.main_specs] == [tuple(map(int, c.split("x"))) for c in bd.CASES]
    assert [label for label, _ in a.variant_items] == [v[0] for v in bd.VARIANTS.values()]
    assert all(s == bd.Spec(B=s.B, L=s.L) for s in a.main_specs)  # the geometry


def test_quick_skips_variants_unless_asked(bd):
    assert bd.parse_args(["--quick"]).variant_items == []
    assert len(bd.parse_args(["--quick", "--variants"]).variant_items) == len(bd.VARIANTS)
    assert len(bd.parse_args(["--quick", "--variants-only"]).variant_items) == len(bd.VARIANTS)


def test_subsets(bd):
    a = bd.parse_args(["--cases", "16x4096,1×1024", "--variants", "fp16,q2"])
    assert [(s.B, s.L) for s in a.main_specs] == [(16, 4096), (1, 1024)]
    assert [label for label, _ in a.variant_items] == ["q_len 2", "fp16"]  # the table's order
    a = bd.parse_args(["--variants-only", "--variants", "nhd"])
    assert a.main_specs == [] and [s.layout for _, s in a.variant_items] == ["NHD"]
    assert bd.parse_args(["--variants", "none"]).variant_items == []


@pytest.mark.parametrize("argv", [["--cases", "16x"], ["--cases", "0x4096"], ["--cases", "16x4096x2"],
                                  ["--variants", "q3"]])
def test_bad_arguments_exit(bd, argv):
    with pytest.raises(SystemExit):
        bd.parse_args(argv)


def test_bytes_follow_the_cache_geometry(bd):
    base = bd.Spec()
    # 16 x 4096 tokens, 8 heads, K and V, 64 code bytes + 8 scale bytes per row of D 128.
    assert bd.nvfp4_bytes(base) == 16 * 4096 * 8 * 2 * 72
    specs = dict(bd.variant_specs(list(bd.VARIANTS)))
    by_label = {label: bd.nvfp4_bytes(s) for label, s in specs.items()}
    for label in ("q_len 2", "q_len 4", "q_len 8", "GQA group 1 (Hq 8)", "GQA group 8 (Hq 64)", "fp16",
                  "NHD (linear scales)", "T 8", "T 1 (linear scales)"):
        assert by_label[label] == bd.nvfp4_bytes(base), label  # the cache read is the same
    assert by_label["D 64"] == bd.nvfp4_bytes(base) // 2
    assert by_label["D 256"] == 2 * bd.nvfp4_bytes(base)
    assert by_label["1x1024 in a CUDA graph"] == 1024 * 8 * 2 * 72
    # Ragged lengths: 256, 768, ..., 7936 (mean 4096), the bytes of 16 x 4096.
    ragged = bd.Spec(ragged=True)
    assert bd.lengths(ragged) == [256 + 512 * i for i in range(16)] and bd.nvfp4_bytes(ragged) == bd.nvfp4_bytes(base)
    assert bd.nvfp4_bytes(bd.Spec(H=4)) == bd.nvfp4_bytes(base) // 2


def test_variants_change_one_thing(bd):
    base = bd.Spec()
    for label, s in bd.variant_specs(list(bd.VARIANTS)):
        changed = {f for f in bd.Spec.__dataclass_fields__ if getattr(s, f) != getattr(base, f)}
        several = ({"B", "L", "graph"}, {"L", "window"}, {"B", "L", "width", "graph"}, {"width", "ragged"},
                   {"B", "L", "width", "cut", "graph"}, {"Hq", "H"}, {"Hq", "H", "T"})
        assert changed and (len(changed) == 1 or changed in several), (label, changed)
        assert s.Hq % s.H == 0 and 1 <= s.q_len <= 8 and s.D in (64, 128, 256)
    # Interleaved V scales need HND rows; the NHD variant reads linear scales.
    assert base.scale_layout == "vllm" and bd.Spec(layout="NHD").scale_layout == "linear"
    assert bd.Spec(T=8).scale_layout == "vllm" and bd.Spec(T=1).scale_layout == "linear"  # T % 4 == 0 or not
    # A window's bytes are those of its tokens: window + 1 of each sequence, or all of a shorter one.
    assert bd.nvfp4_bytes(bd.Spec(L=32768, window=4095)) == bd.nvfp4_bytes(bd.Spec(L=4096))
    assert bd.nvfp4_bytes(bd.Spec(L=100, window=4095)) == bd.nvfp4_bytes(bd.Spec(L=100))


def test_rows_format(bd):
    row = dict(bd.Spec(q_len=4).__dict__, label="q_len 4", gpu_us=30.0, sdpa_us=90.0, x_sdpa=3.0, frac_copy=0.6,
               copy_us=18.0, sdpa_mask="causal lower-right", sdpa_nomask_us=88.0, timing="queued")
    line = bd.format_variant(row)
    assert line.split()[2:7] == ["30.00", "60.0%", "90.00", "3.00x", "causal"] and "no mask 88.00 us" in line
    assert "FAILED: RuntimeError: x" in bd.format_variant(dict(label="D 64", error="RuntimeError: x"))
    main = dict(bd.Spec().__dict__, gpu_us=25.0, sdpa_us=80.0, x_sdpa=3.2, frac_copy=0.72, copy_us=18.0,
                sized_copy_us=20.0, frac_sized_copy=0.8, graph_us=4.0, sdpa_graph_us=6.0)
    assert bd.format_row(main).split()[:6] == ["16", "x", "4096", "nvfp4", "25.00", "us"]
    assert "a copy of them 20.0 us: 80.0%" in bd.format_row(main)
    assert "graph 4.00 us (SDPA 6.00)" in bd.format_row(main)


def test_input_sets_cover_three_l2s(bd):
    l2 = 50 << 20  # the H100's and H200's
    for s in (bd.Spec(), bd.Spec(L=2048), bd.Spec(D=64)):  # 75.5 MB a call, 37.7, 37.7
        n, sets = bd.nvfp4_bytes(s), bd.input_sets(bd.nvfp4_bytes(s), l2)
        assert (sets - 1) * n < 3 * l2 <= sets * n
    assert bd.input_sets(bd.nvfp4_bytes(bd.Spec()), l2) == 3
    assert bd.input_sets(1 << 20, l2) == bd.GRAPH_CALLS  # 150 would be more sets than a graph's captures
    assert bd.input_sets(1 << 30, l2) == 1
    assert bd.input_sets(0, l2) == bd.GRAPH_CALLS


def test_make_case_on_gpu(bd):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("nvfp4kv")
    for s in (bd.Spec(B=2, L=64, q_len=2), bd.Spec(B=2, L=64, layout="NHD", D=64, dtype="float16"),
              bd.Spec(B=2, L=64, width=1024, cut=True)):
        c = bd.make_case(s)
        c["ours"]()
        c["sdpa"]()
        torch.cuda.synchronize()
        assert c["out"].shape == (s.B * s.q_len, s.Hq, s.D) and bool(c["out"].isfinite().all())
        assert c["sdpa_mask"] == "causal lower-right" if s.q_len > 1 else c["sdpa_mask"].startswith("none")
        assert c["sdpa_bytes"] == 2 * s.B * s.H * s.L * s.D * 2
        # Each set reads pages of its own in the columns a call reads; a wide table's other
        # columns are set 0's.
        used = (s.L + s.T - 1) // s.T
        tables = [t.cpu() for t in c["tables"]]
        assert len(tables) == c["sets"] > 1
        read = torch.cat([t[:, :used].reshape(-1) for t in tables])
        assert read.unique().numel() == read.numel()
        assert all(torch.equal(t[:, used:], tables[0][:, used:]) for t in tables)


def test_no_gpu_says_so(bd, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bd.main(["--quick"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
