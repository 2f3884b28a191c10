"""examples/sdpa_prefill.py: prefill SDPA over an NVFP4 cache written by reshape_and_cache_flash and
read by gather_dequant, on a small CPU case."""
import math
import os

import numpy as np
import pytest
from conftest import load_example

torch = pytest.importorskip("torch")
pytest.importorskip("nvfp4kv")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "sdpa_prefill.py")


@pytest.fixture(scope="module")
def example():
    return load_example(EXAMPLE)


@pytest.fixture(scope="module")
def run(example):
    # GQA (8 query heads on 2 KV heads), a 1-token and a 0-token sequence, partial last pages.
    argv = ["--device", "cpu", "--seq-lens", "97,33,1,0,64", "--heads", "8", "--kv-heads", "2",
            "--head-size", "128", "--seed", "1"]
    return example.main(argv, keep_tensors=True)


def test_errors_sane(run, capsys):
    for recipe in ("nvfp4", "nvfp4_4over6"):
        for what in ("attn", "k", "v"):
            r = run[recipe][what]
            assert math.isfinite(r["rel_l2"]) and math.isfinite(r["cosine"]), (recipe, what, r)
            assert 1e-3 < r["rel_l2"] < 0.2, (recipe, what, r)
            assert 0.97 < r["cosine"] <= 1.0 + 1e-12, (recipe, what, r)
    a, b = run["nvfp4"]["attn"]["rel_l2"], run["nvfp4_4over6"]["attn"]["rel_l2"]
    assert b <= 1.1 * a, f"4over6 attention error {b} vs nvfp4 {a}"


def test_gathered_kv_equal_dequantize_at_slots(run):
    import nvfp4kv

    for recipe in ("nvfp4", "nvfp4_4over6"):
        t = run["tensors"][recipe]
        kd, vd = nvfp4kv.dequantize(t["kv_cache"], t["k_scale"], t["v_scale"], dtype="bfloat16",
                                    scale_layout=t["scale_layout"])
        N, T, H, D = kd.shape
        slots = t["slot_mapping"]
        assert t["k_hat"].shape == (slots.shape[0], H, D)
        want_k = kd.reshape(N * T, H, D)[slots]
        want_v = vd.reshape(N * T, H, D)[slots]
        assert torch.equal(t["k_hat"].view(torch.int16), want_k.view(torch.int16))
        assert torch.equal(t["v_hat"].view(torch.int16), want_v.view(torch.int16))
        cu = t["cu_seqlens"].tolist()
        assert cu == [0, 97, 130, 131, 131, 195]
        # the slot mapping follows the block table
        bt, T_ = t["block_table"], T
        for b, n in enumerate(t["seq_lens"].tolist()):
            j = torch.arange(n)
            assert torch.equal(slots[cu[b]:cu[b + 1]], bt[b, j // T_].long() * T_ + j % T_)


def test_cache_bytes_match_store(run):
    """The example's cache holds exactly what nvfp4kv.store writes for the same K/V (two-sided
    reshape_and_cache_flash == store on the 5-D cache)."""
    import nvfp4kv

    for recipe in ("nvfp4", "nvfp4_4over6"):
        t = run["tensors"][recipe]
        kv = torch.zeros_like(t["kv_cache"])
        nvfp4kv.store(t["key"], t["value"], kv, t["slot_mapping"], t["k_scale"], t["v_scale"],
                      recipe=recipe, scale_layout=t["scale_layout"])
        assert torch.equal(kv, t["kv_cache"])


def test_command_line_prints_table(example, capsys):
    r = example.main(["--device", "cpu", "--seq-lens", "20,5", "--heads", "2", "--kv-heads", "1",
                      "--head-size", "48", "--block-size", "5"])
    out = capsys.readouterr().out
    assert "nvfp4_4over6" in out and "attn rel L2" in out
    assert r["config"]["scale_layout"] == "linear"  # D % 64 != 0
    assert np.isfinite(r["nvfp4"]["attn"]["rel_l2"])
    with pytest.raises(SystemExit):
        example.main(["--heads", "3", "--kv-heads", "2"])


@pytest.mark.parametrize("argv", [["--kv-heads", "0"], ["--block-size", "0"], ["--seq-lens", "abc"],
                                  ["--seq-lens", "0,0"], ["--head-size", "0"], ["--extra-blocks", "-1"],
                                  ["--device", "tpu"], ["--device", "nonsense"], ["--heads", "0"],
                                  ["--head-size", "528"]])
def test_bad_arguments_are_one_line_errors(example, capsys, argv):
    """Found by review: these ended in tracebacks (ZeroDivisionError, torch errors)."""
    with pytest.raises(SystemExit) as e:
        example.main(["--device", "cpu"] + argv if argv[0] != "--device" else argv)
    assert e.value.code == 2
    assert ": error: --" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_one_line_error(example, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as e:
        example.main(["--device", "cuda"])
    assert e.value.code == 2 and "no usable GPU" in capsys.readouterr().err
