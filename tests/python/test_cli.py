"""The ``nvfp4kv`` command line (python/nvfp4kv/cli/): output, JSON schema, exit codes, and the
capacity planner's numbers against hand-computed cases.

Most tests call ``cli.main([...])`` in-process; a few run ``python -m nvfp4kv`` as a user would.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
from nvfp4kv import cli
from nvfp4kv.models import MODELS

GiB = 1024**3


def run(*argv):
    """(exit status, stdout, stderr) of cli.main(argv), in-process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def run_json(*argv):
    rc, out, err = run(*argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def has_gpu():
    try:
        import torch
    except ImportError:
        return False
    import nvfp4kv

    return torch.cuda.is_available() and nvfp4kv.build_info()["cuda_available"]


def python_m(*argv, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "nvfp4kv", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------------------- help, version
@pytest.mark.parametrize("sub", [[], ["demo"], ["plan"], ["bench"], ["info"]])
def test_help(sub):
    rc, out, _err = run(*sub, "--help")
    assert rc == 0
    assert out.startswith("usage: nvfp4kv")
    if sub:
        assert "--json" in out


@pytest.mark.parametrize("argv", [["--version"], ["--tokens", "16", "--version"], ["--json", "--version"],
                                  ["--version", "--tokens", "16"]])
def test_version(argv):
    import nvfp4kv

    rc, out, err = run(*argv)
    assert (rc, err) == (0, "")
    assert out.strip() == f"nvfp4kv {nvfp4kv.__version__}"


def test_plan_reads_a_utilization_percentage():
    assert run_json("plan", "--utilization", "90%") == run_json("plan", "--utilization", "0.9")
    assert run_json("plan", "--utilization", "12.5%")["utilization"] == 0.125


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["frob"], "invalid choice"),
        (["plan", "--memory", "80G"], "ambiguous"),
        (["plan", "--memory", "1t"], "ambiguous"),
        (["plan", "--memory", "lots"], "not a size"),
        (["plan", "--memory", "80 parsecs"], "unknown unit"),
        (["plan", "--utilization", "1.5"], "not in (0, 1]"),
        (["plan", "--utilization", "0"], "not in (0, 1]"),
        (["plan", "--utilization", "150%"], "150% is not in (0, 1]"),
        (["plan", "--utilization", "%"], "not a number"),
        (["plan", "--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["plan", "--block-size", "-16"], "not a positive integer"),
        (["plan", "--context", "many"], "not an integer"),
        (["demo", "--tokens", "0"], "not a positive integer"),
        (["demo", "--device", "tpu"], "invalid choice"),
        (["info", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, needle):
    rc, out, err = run(*argv)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("nvfp4kv") and "error:" in err and needle in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, prog", [(["plan", "--frob"], "nvfp4kv plan"), (["info", "--tokens", "5"], "nvfp4kv info"),
                                        (["--frob"], "nvfp4kv demo"), (["bench", "x"], "nvfp4kv bench"),
                                        # full names only: --mem is not --memory (nor --tok --tokens)
                                        (["plan", "--mem", "80GB"], "nvfp4kv plan"),
                                        (["demo", "--tok", "64"], "nvfp4kv demo")])
def test_unknown_options_are_reported_by_their_subcommand(argv, prog):
    rc, out, err = run(*argv)
    assert rc == 2 and out == ""
    assert err == f"{prog}: error: unrecognized arguments: {' '.join(argv[1:] or argv)} (see '{prog} --help')\n", err


# Issue #21 item 9: every bad argument of every subcommand, including the ones that only show as
# bad after parsing, exits 2 with one line in argparse's style, without a traceback.
@pytest.mark.parametrize(
    "argv, needle",
    [
        # sizes: absurd exponents and lengths are rejected before any arithmetic
        (["plan", "--memory", "1e400GiB"], "exponent out of range"),
        (["plan", "--memory", "1e100000000"], "exponent out of range"),
        (["plan", "--memory", "1e-100000000"], "exponent out of range"),
        (["plan", "--weights", "1e400GiB"], "exponent out of range"),
        (["plan", "--memory", "1e20GiB"], "too large (at most 2**60 bytes"),
        (["plan", "--memory", "1048577TiB"], "too large (at most 2**60 bytes"),
        (["plan", "--memory", "9" * 5000], "too long"),
        (["plan", "--memory=-1GiB"], "cannot be negative"),
        # fractions
        (["plan", "--utilization", "1e-100000000"], "exponent out of range"),
        (["plan", "--utilization", "1e1_00000000"], "exponent out of range"),
        (["plan", "--utilization", "1/0"], "not a number"),
        (["plan", "--utilization", "2\nx"], "not a number"),
        (["plan", "--utilization", " 2\n"], "2 is not in (0, 1]"),
        (["plan", "--utilization", "1" * 5000], "too long"),
        # counts
        (["plan", "--layers", "1" + "0" * 30], "too large"),
        (["plan", "--kv-heads", "9" * 5000], "too long"),
        (["plan", "--block-size", "0"], "not a positive integer"),
        (["plan", "--context", "1.5"], "not an integer"),
        # model names
        (["plan", "--model", ""], "unknown model ''"),
        (["plan", "--model", "gpt\n9"], "unknown model 'gpt\\n9'"),
        # head sizes: a multiple of 16 from 16 to 512, whatever KVCacheSpec accepts
        (["plan", "--head-size", "1024"], "not a supported head size"),
        (["plan", "--head-size", "4096"], "not a supported head size"),
        (["plan", "--head-size", "100"], "not a supported head size"),
        (["plan", "--head-size", "8"], "not a supported head size"),
        (["plan", "--model", "gemma-2-9b", "--head-size", "528"], "not a supported head size"),
        # memory too small for the weights
        (["plan", "--weights", "100GiB"], "exceed the usable memory"),
        (["plan", "--memory", "0"], "no memory is left for the cache"),
        (["plan", "--memory", "10GiB", "--utilization", "0.5", "--weights", "5GiB"], "no memory is left"),
        (
            ["plan", "--memory", "1GiB", "--utilization", "0.5", "--weights", "513MiB"],
            "exceed the usable memory",
        ),
        # demo: sizes beyond what the machine could allocate, seeds, devices and backends
        (["demo", "--tokens", "1000000000000"], "tokens need about"),
        (["demo", "--tokens", "1" + "0" * 30], "too large"),
        (["demo", "--seed", "-1"], "not a non-negative integer"),
        (["demo", "--seed", "x"], "not an integer"),
        (["demo", "--device", "cuda", "--backend", "numpy"], "--backend numpy only works"),
        (["demo", "--backend", "jax"], "invalid choice"),
        # bench: where the JSON goes is checked before the benchmark runs
        (["bench", "--output", "/nonexistent-dir/x.json"], "does not exist"),
        (["bench", "--output", "."], "is a directory"),
        (["bench", "--output", ""], "empty path"),
        (["bench", "--output", __file__], "exists; choose a new path"),
        # a directory that takes no files though os.access says it does (root; /proc on Linux)
        pytest.param(["bench", "--output", "/proc/nvfp4kv-x.json"], "cannot create a file",
                     marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")),
    ],
)
def test_bad_arguments_after_parsing_exit_2_with_one_line(argv, needle):
    rc, out, err = run(*argv)
    assert rc == 2, err
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"nvfp4kv {argv[0]}: error: "), err
    assert err.endswith(f"(see 'nvfp4kv {argv[0]} --help')\n"), err
    assert needle in err, err
    assert "Traceback" not in err


def test_weights_error_names_the_sizes():
    rc, _out, err = run("plan", "--weights", "100GiB")
    assert rc == 2
    assert err == (
        "nvfp4kv plan: error: the weights (100.00 GiB) exceed the usable memory "
        "(80.00 GiB x 0.9 = 72.00 GiB) (see 'nvfp4kv plan --help')\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--memory", "1e100000000"],
        ["plan", "--memory", "1e-100000000"],
        ["plan", "--weights", "1e99999999GiB"],
        ["plan", "--utilization", "1e-100000000"],
        ["plan", "--context", "9" * 4300],
        ["demo", "--tokens", "9" * 4300],
    ],
)
def test_huge_numbers_are_rejected_within_a_second(argv):
    start = time.perf_counter()
    rc, _out, err = run(*argv)
    assert time.perf_counter() - start < 1.0
    assert rc == 2 and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--tokens", "1000000000000"],
        ["plan", "--memory", "1e400GiB"],
        ["plan", "--memory", "1e100000000"],
        ["plan", "--head-size", "4096"],
        ["plan", "--weights", "100GiB"],
    ],
)
def test_attacker_cases_in_subprocess(argv):
    # Issue #21: a MemoryError traceback, an OverflowError traceback, minutes of big-number
    # arithmetic, exit 0 for an unsupported head size, exit 1 for weights beyond the memory.
    p = python_m(*argv, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"nvfp4kv {argv[0]}: error: ")


def test_size_limits():
    assert cli.parse_size("1048576TiB") == 2**60
    assert cli.parse_size(str(2**60)) == 2**60
    assert cli.parse_size("1e-3KiB") == 1
    assert cli.parse_size("1e18B") == 10**18
    for text in (str(2**60 + 1), "1e19", "1e101", "1e-101", "1" * 101, "1e400GiB"):
        with pytest.raises(ValueError):
            cli.parse_size(text)


def test_usage_error_is_a_cli_error_from_the_api():
    from nvfp4kv.cli.plan import plan_capacity

    assert issubclass(cli.UsageError, cli.CLIError)
    with pytest.raises(cli.CLIError, match="exceed the usable memory"):
        plan_capacity(MODELS["llama-3.1-8b"], 2**30, weights_bytes=2**31)
    with pytest.raises(cli.UsageError, match="tokens need about"):
        cli.run_demo(tokens=10**12, device="cpu")


def test_demo_tokens_checked_against_the_memory_limit(monkeypatch):
    from nvfp4kv.cli import demo

    # 2048 tokens of Llama-3.1-8B geometry: 2 x 8 x 128 elements x 32 B = 64 KiB per token.
    monkeypatch.setattr(demo, "_memory_limit", lambda: 100 * 64 * 1024)
    rc, out, err = run("demo", "--tokens", "2048", "--device", "cpu")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "(at most 100 tokens)" in err
    rc, _out, err = run("demo", "--tokens", "64", "--device", "cpu", "--backend", "numpy", "-q")
    assert rc == 0, err


def test_memory_limit_is_sane():
    from nvfp4kv.cli._common import _memory_limit

    assert 2**20 < _memory_limit() <= 2**40


def test_plan_text_counts_one_layer_and_one_head_in_the_singular():
    rc, out, err = run("plan", "--layers", "1", "--kv-heads", "1", "--head-size", "64")
    assert rc == 0, err
    assert "1 layer, 1 KV head, head size 64" in out and "page B (1 layer)" in out
    assert "layers" not in out and "heads" not in out
    rc, out, err = run("plan", "--layers", "2", "--kv-heads", "8", "--head-size", "64")
    assert rc == 0, err
    assert "2 layers, 8 KV heads" in out and "page B (2 layers)" in out


def test_plan_supported_head_sizes_still_work():
    for d in (16, 64, 256, 512):
        r = run_json("plan", "--layers", "2", "--kv-heads", "1", "--head-size", str(d))
        assert r["model"]["head_size"] == d


def test_runtime_geometry_errors_from_kvcachespec_exit_2(monkeypatch):
    # Whatever KVCacheSpec rejects for the geometry given is a bad argument too (exit 2), even
    # where the CLI's own argument types let it through.
    from nvfp4kv.cli import plan

    def reject(*args, **kwargs):
        raise ValueError("num_kv_heads too large")

    monkeypatch.setattr(plan, "_format_sizes", reject)
    rc, out, err = run("plan", "--kv-heads", "4")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err == "nvfp4kv plan: error: num_kv_heads too large (see 'nvfp4kv plan --help')\n"


def test_usage_error_message_with_line_breaks_is_one_line(monkeypatch):
    from nvfp4kv.cli import plan

    def reject(*args, **kwargs):
        raise ValueError("first\nsecond\r\nthird")

    monkeypatch.setattr(plan, "_format_sizes", reject)
    rc, _out, err = run("plan")
    assert rc == 2 and err.count("\n") == 1 and "first second third" in err, err


def test_memory_error_is_one_line_exit_1(monkeypatch):
    from nvfp4kv.cli import info

    def boom():
        raise MemoryError()

    monkeypatch.setattr(info, "collect_info", boom)
    rc, out, err = run("info")
    assert rc == 1 and out == ""
    assert err == "nvfp4kv info: error: out of memory\n"


@pytest.mark.skipif(has_gpu(), reason="checks the no-GPU message")
def test_bench_without_gpu_exits_1():
    rc, out, err = run("bench", "--quick")
    assert rc == 1
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("nvfp4kv bench: error: ")


def test_options_alone_go_to_demo_and_debug_0_is_off(monkeypatch):
    """`nvfp4kv --json` is `nvfp4kv demo --json` (the docs: demo is the default); NVFP4KV_DEBUG=0
    keeps the one-line errors."""
    rc, out, err = run("--json", "--tokens", "64", "--device", "cpu", "-q")
    assert rc == 0 and json.loads(out)["command"] == "demo"
    monkeypatch.setenv("NVFP4KV_DEBUG", "0")
    rc, out, err = run("plan", "--memory", "80G")
    assert rc == 2 and err.count("\n") == 1


def test_common_options_before_the_subcommand():
    """Found by review: `nvfp4kv --json plan` was refused as an unknown --json (the option of every
    subcommand, given before it); it is `nvfp4kv plan --json` now. Other leading options are an
    error: one line that names them, and the subcommand where it does not take them."""
    rc, out, err = run("--json", "-q", "plan", "--memory", "80GiB")
    assert rc == 0, err
    assert json.loads(out)["command"] == "plan"
    rc, out, err = run("--tokens", "64", "plan")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("nvfp4kv plan: error: --tokens 64: plan does")


def test_closed_stdout_and_stderr_in_subprocess():
    """Found by review: with stdout closed the command printed nowhere and exited 0; with stderr
    closed `demo -q` failed flushing the progress it was told not to show."""
    cmd = [sys.executable, "-m", "nvfp4kv"]
    p = subprocess.run(cmd + ["plan"], stdout=subprocess.DEVNULL, capture_output=False, check=False,
                       stderr=subprocess.PIPE, text=True, timeout=120, close_fds=True,
                       preexec_fn=lambda: os.close(1))
    assert p.returncode == 1 and p.stderr == "nvfp4kv: error: stdout is closed; nowhere to print the results\n"
    p = subprocess.run(cmd + ["demo", "-q", "--tokens", "64", "--device", "cpu"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, check=False, text=True, timeout=120,
                       preexec_fn=lambda: os.close(2))
    assert p.returncode == 0 and "demo: llama-3.1-8b geometry" in p.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_help_and_version_that_cannot_be_written_are_errors():
    """Found by review: `nvfp4kv --help > /dev/full` exited 0 and said nothing (the text waited in
    stdout's buffer past main's return); now 1 with its line, as a subcommand's output. A reader
    gone (`--help | head -1`) is still no error."""
    cmd = [sys.executable, "-m", "nvfp4kv"]
    for args, buffered in ((["--help"], True), (["--help"], False), (["--version"], True), (["plan", "--help"], False)):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        if not buffered:  # the write itself fails, not the flush
            env["PYTHONUNBUFFERED"] = "1"
        with open("/dev/full", "w") as full:
            p = subprocess.run(cmd + args, stdout=full, stderr=subprocess.PIPE, check=False, text=True, timeout=120,
                               env=env)
        assert p.returncode == 1 and p.stderr.count("\n") == 1, (args, buffered, p.returncode, p.stderr)
        assert p.stderr.startswith("nvfp4kv: error: [Errno 28]"), (args, p.stderr)
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run(cmd + ["--help"], stdout=write, stderr=subprocess.PIPE, check=False, text=True, timeout=120)
    finally:
        os.close(write)
    assert p.returncode == 0 and p.stderr == ""


def test_help_after_demo_options_is_demos():
    """`nvfp4kv --tokens 16` is the demo, so `nvfp4kv --tokens 16 --help` shows the demo's help
    (review: argparse called 16 an invalid subcommand); --help alone stays the command's."""
    rc, out, err = run("--tokens", "16", "--help")
    assert rc == 0 and out.startswith("usage: nvfp4kv demo"), err
    rc, out, err = run("--json", "--help")
    assert rc == 0 and out.startswith("usage: nvfp4kv [-h]"), err


def test_stderr_closed_or_unread_keeps_the_exit_statuses():
    """Found by review: with stderr closed a bad argument exited 1 (writing its line to None
    raised), and with stderr's reader gone the first progress line raised BrokenPipeError, which
    was taken for stdout's: the demo stopped there and exited 0 with nothing on stdout."""
    cmd = [sys.executable, "-m", "nvfp4kv"]
    p = subprocess.run(cmd + ["plan", "--weights", "100GiB"], stdout=subprocess.PIPE, check=False, text=True,
                       timeout=120, preexec_fn=lambda: os.close(2))
    assert p.returncode == 2 and p.stdout == ""
    read, write = os.pipe()
    os.close(read)  # nobody reads stderr: a write to it raises BrokenPipeError (Python ignores SIGPIPE)
    try:
        p = subprocess.run(cmd + ["demo", "--tokens", "64", "--device", "cpu"], stdout=subprocess.PIPE,
                           stderr=write, check=False, text=True, timeout=120)
    finally:
        os.close(write)
    assert p.returncode == 0 and "demo: llama-3.1-8b geometry" in p.stdout


def test_debug_shows_the_traceback_and_keeps_the_status(monkeypatch):
    """NVFP4KV_DEBUG=1 re-raised, so a bad argument found after parsing exited 1 (review); now the
    traceback comes before the usual line and the status stays 2."""
    monkeypatch.setenv("NVFP4KV_DEBUG", "1")
    rc, out, err = run("plan", "--weights", "100GiB")
    assert rc == 2 and out == ""
    assert err.startswith("Traceback") and err.splitlines()[-1].startswith("nvfp4kv plan: error: ")


def test_an_unexpected_exception_is_one_line(monkeypatch):
    """Found by review: main caught a list of exception types, so another one (a torch whose
    import raised AttributeError) reached the user as a traceback."""
    def broken():
        raise AttributeError("module 'torch' has no attribute 'cuda'")

    monkeypatch.setattr(cli.info, "collect_info", broken)
    rc, out, err = run("info")
    assert rc == 1 and out == ""
    assert err == "nvfp4kv info: error: AttributeError: module 'torch' has no attribute 'cuda'\n"


def test_an_exponent_in_other_digits_is_refused_at_once():
    """Found by review: the exponent check read ASCII digits only, and Fraction reads any script's,
    so `1e-` followed by 10^8 in Arabic-Indic digits computed for minutes."""
    start = time.monotonic()
    for text in ("1e-\u0661" + "\u0660" * 8, "1e1" + "\u0660" * 8):
        rc, out, err = run("plan", "--utilization", text)
        assert rc == 2 and "exponent out of range" in err, err
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("argv", [["plan", "--layers", "1_0"], ["plan", "--layers", "\uff13\uff12"],
                                  ["plan", "--utilization", "\uff10.\uff19"], ["plan", "--utilization", "0.9_0"],
                                  ["demo", "--seed", "\u0661"]])
def test_counts_and_fractions_are_written_as_sizes_are(argv):
    """Found by review: counts and fractions took other scripts' digits and underscores (int() and
    Fraction() read them), where sizes refuse them: one rule now, ASCII digits only."""
    rc, out, err = run(*argv)
    assert rc == 2 and out == "" and ("is not an integer" in err or "is not a number" in err), err


def test_bench_output_name_too_long_is_refused_before_the_run(tmp_path):
    """Found by review: the probe file's own short name passed, so a name too long for the file
    system failed only when the results were written, after the benchmark."""
    rc, out, err = run("bench", "--output", str(tmp_path / ("y" * 300 + ".json")))
    assert rc == 2 and "file name is longer" in err, err
    file = tmp_path / "f"
    file.write_text("")
    rc, out, err = run("bench", "--output", str(file / "x.json"))
    assert rc == 2 and "is not a directory" in err, err


def test_bad_argument_in_subprocess_has_no_traceback():
    p = python_m("plan", "--memory", "80G")
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


# ----------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 85899345920),
        ("80GB", 80000000000),
        (" 2 gib ", 2147483648),
        ("512MiB", 536870912),
        ("1.5KiB", 1536),
        ("141GB", 141000000000),
        ("1e9", 1000000000),
        ("123", 123),
        ("123B", 123),
        ("100000KB", 10**8),  # decimal units are powers of 10 (mutation testing: KB as 2^10 passed)
        ("3MB", 3 * 10**6),
        ("2TB", 2 * 10**12),
        ("3KiB", 3072),
        ("2TiB", 2 * 2**40),
    ],
)
def test_parse_size(text, expected):
    assert cli.parse_size(text) == expected


# ---------------------------------------------------------------------------------- planner
def _by_name(result):
    return {f["name"]: f for f in result["formats"]}


def test_plan_llama_8b_hand_computed():
    r = run_json(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--memory",
        "80GiB",
        "--utilization",
        "0.9",
        "--weights",
        "16GiB",
        "--block-size",
        "16",
        "--context",
        "8192",
    )
    # 80 GiB x 0.9 = 72 GiB; minus 16 GiB of weights = 56 GiB.
    budget = 56 * 1073741824
    assert budget == 60129542144
    assert r["memory_bytes"] == 85899345920
    assert r["weights_bytes"] == 17179869184
    assert r["kv_budget_bytes"] == budget
    assert r["pages_per_sequence"] == 8192 // 16 == 512
    f = _by_name(r)
    assert [x["name"] for x in r["formats"]] == ["bf16", "fp8", "nvfp4"]
    # nvfp4 page, one layer: T*H*2*(D/2 + D/16) = 16*8*2*72 = 18432; 32 layers = 589824.
    assert f["nvfp4"]["page_bytes"] == 32 * 18432 == 589824
    assert f["nvfp4"]["pages"] == 101944  # 60129542144 / 589824 = 101944.9
    assert f["nvfp4"]["max_tokens"] == 101944 * 16 == 1631104
    assert f["nvfp4"]["max_sequences"] == 199  # 101944 / 512 = 199.1
    # bf16 page: 16*8*2*128*2 = 65536 per layer, x32 = 2 MiB.
    assert f["bf16"]["page_bytes"] == 2097152
    assert f["bf16"]["pages"] == 28672 and f["bf16"]["max_tokens"] == 458752
    assert f["bf16"]["max_sequences"] == 56
    assert f["fp8"]["page_bytes"] == 1048576
    assert f["fp8"]["pages"] == 57344 and f["fp8"]["max_tokens"] == 917504
    assert f["fp8"]["max_sequences"] == 112
    assert f["bf16"]["gain_vs_bf16"] == 1.0
    assert f["fp8"]["gain_vs_bf16"] == 2.0
    assert f["nvfp4"]["gain_vs_bf16"] == pytest.approx(1631104 / 458752)
    assert f["nvfp4"]["bytes_per_token"] == 32 * 8 * 144 == 36864



def test_plan_tensor_parallel_size_shares_the_kv_heads():
    """--tensor-parallel-size N: each GPU caches max(1, H // N) KV heads (vLLM's get_num_kv_heads),
    with --memory and --weights one GPU's, so its numbers are those of that many heads; N must
    divide H or be a multiple of it (vLLM's attention layers assert one or the other)."""
    base = ("plan", "--model", "llama-3.1-70b", "--weights", "17.5GiB")
    for tp, heads in ((2, 4), (8, 1), (16, 1)):  # 16 > 8 heads: each GPU keeps a copy of one
        r = run_json(*base, "--tensor-parallel-size", str(tp))
        assert r["tensor_parallel_size"] == tp and r["kv_heads_per_gpu"] == heads
        assert r["model"]["kv_heads"] == 8  # the model's own
        assert r["formats"] == run_json(*base, "--kv-heads", str(heads))["formats"]
    # 70B at 8 GPUs: 80 layers x 16 tokens x 1 head x 2 x 72 bytes a page; 54.5 GiB of 80 x 0.9 - 17.5.
    f = _by_name(run_json(*base, "--tensor-parallel-size", "8"))
    assert f["nvfp4"]["page_bytes"] == 80 * 16 * 2 * 72 == 184320
    assert f["nvfp4"]["pages"] == (72 - 17.5) * 2**30 // 184320 == 317485
    assert run_json(*base)["tensor_parallel_size"] == 1
    rc, out, _err = run(*base, "--tensor-parallel-size", "8")
    assert rc == 0 and "8 KV heads (1 per GPU at tensor parallel size 8)" in out and "memory:  each GPU: " in out
    rc, out, _err = run("plan", "--model", "llama-3.1-70b", "--tensor-parallel-size", "8")
    assert rc == 0 and "2 bytes per parameter / 8 per GPU for bf16 weights" in out
    rc, out, _err = run(*base)
    assert rc == 0 and "per GPU" not in out and "each GPU" not in out
    for tp in ("3", "12"):
        rc, _out, err = run(*base, "--tensor-parallel-size", tp)
        assert rc == 2 and f"--tensor-parallel-size {tp}: 8 KV heads cannot be shared over {tp} GPUs" in err
    rc, _out, err = run(*base, "--tensor-parallel-size", "0")
    assert rc == 2 and "not a positive integer" in err


def test_plan_context_not_a_multiple_of_the_block_size():
    # 8200 tokens of 16 take 513 pages, the last partly filled (mutation testing: pages per
    # sequence rounded down passed every test, whose contexts were multiples of the block size).
    r = run_json("plan", "--model", "llama-3.1-8b", "--memory", "80GiB", "--utilization", "0.9", "--weights",
                 "16GiB", "--block-size", "16", "--context", "8200")
    assert r["pages_per_sequence"] == 513
    f = _by_name(r)
    assert f["nvfp4"]["pages"] == 101944  # as at 8192 (test above): the budget is the same
    assert f["nvfp4"]["max_sequences"] == 101944 // 513 == 198
    assert f["bf16"]["max_sequences"] == 28672 // 513 == 55


def test_plan_boundaries_from_mutation_testing():
    """Cases that mutants of plan.py and _common.py passed: sequences counted in pages (a context
    of 17 takes 2 pages of 16, not 17 tokens), an exact budget at the size limit, the format
    records' keys, the sliding-window note, the largest count, the length limit of a number and
    binary units printed from exactly one unit."""
    r = run_json("plan", "--model", "llama-3.1-8b", "--memory", "80GiB", "--utilization", "0.9", "--weights",
                 "16GiB", "--block-size", "16", "--context", "17")
    f = _by_name(r)
    assert r["pages_per_sequence"] == 2 and f["nvfp4"]["max_sequences"] == 101944 // 2
    r = run_json("plan", "--memory", "1048576TiB", "--utilization", "0.9")
    assert r["kv_budget_bytes"] == 2**60 * 9 // 10  # exact, not through a float
    assert all(set(x) == {"name", "cache_dtype", "page_bytes_per_layer", "page_bytes", "bytes_per_token",
                          "gain_vs_bf16", "pages", "max_tokens", "max_sequences"} for x in r["formats"])
    rc, out, _err = run("plan", "--model", "gemma-2-9b")
    assert rc == 0 and "note: alternates sliding-window (4096)" in out
    rc, _out, err = run("plan", "--layers", str(2**63 - 1), "--json")
    assert rc == 0, err
    rc, _out, err = run("plan", "--utilization", "0." + "9" * 98)  # 100 characters: accepted
    assert rc == 0, err
    rc, _out, err = run("plan", "--utilization", "0." + "9" * 99)
    assert rc == 2 and "too long" in err
    rc, _out, err = run("plan", "--layers", "0" * 99 + "1", "--json")  # an integer: the same limit
    assert rc == 0, err
    rc, _out, err = run("plan", "--layers", "0" * 100 + "1")
    assert rc == 2 and "too long" in err
    assert cli._common._human_bytes(2**30) == "1.00 GiB" and cli._common._human_bytes(2**30 - 1) == "1024.00 MiB"


def test_plan_refuses_an_nvfp4_page_side_no_operation_takes():
    """Found by review: plan printed page counts for NVFP4 pages whose side (T * H * F) is 2 GiB
    or more, which allocate_kv_cache and every operation refuse. The largest side passes."""
    rc, _out, err = run("plan", "--kv-heads", "4194304", "--block-size", "64", "--head-size", "128", "--layers", "1")
    assert rc == 2 and "2 GiB" in err and err.count("\n") == 1, err
    rc, _out, err = run("plan", "--block-size", str(2**63 - 1))
    assert rc == 2 and "2 GiB" in err, err
    rc, _out, err = run("plan", "--kv-heads", "1", "--block-size", "29826161", "--head-size", "128", "--layers", "1",
                        "--json")
    assert rc == 0, err


def test_plan_qwen_7b_decimal_units_hand_computed():
    r = run_json(
        "plan",
        "--model",
        "qwen2.5-7b",
        "--memory",
        "24GiB",
        "--utilization",
        "1",
        "--weights",
        "15GB",
        "--block-size",
        "32",
        "--context",
        "4096",
    )
    budget = 24 * 1073741824 - 15000000000
    assert r["kv_budget_bytes"] == budget == 10769803776
    f = _by_name(r)
    # 28 layers, 4 KV heads, D = 128, T = 32. Pages per sequence: 4096 / 32 = 128.
    assert f["bf16"]["page_bytes"] == 28 * 32 * 4 * 256 * 2 == 1835008
    assert f["bf16"]["pages"] == 5869 and f["bf16"]["max_tokens"] == 187808
    assert f["bf16"]["max_sequences"] == 45
    assert f["fp8"]["page_bytes"] == 917504
    assert f["fp8"]["pages"] == 11738 and f["fp8"]["max_sequences"] == 91
    assert f["nvfp4"]["page_bytes"] == 28 * 32 * 4 * 144 == 516096
    assert f["nvfp4"]["pages"] == 20867  # 10769803776 / 516096 = 20867.8
    assert f["nvfp4"]["max_tokens"] == 667744
    assert f["nvfp4"]["max_sequences"] == 163


def test_plan_head_size_256_and_overrides():
    f = _by_name(
        run_json("plan", "--model", "gemma-2-9b", "--memory", "1GiB", "--utilization", "1")
    )
    # D = 256: F = 128 + 16 = 144 bytes per row and side; 16*8*2*144 = 36864 per layer, x42.
    assert f["nvfp4"]["page_bytes"] == 42 * 36864
    assert f["nvfp4"]["pages"] == 1073741824 // (42 * 36864) == 693

    r = run_json("plan", "--layers", "10", "--kv-heads", "2", "--head-size", "64")
    assert r["model"]["name"] == "custom"
    assert _by_name(r)["nvfp4"]["page_bytes"] == 10 * 16 * 2 * 2 * (32 + 4) == 23040

    r = run_json("plan", "--model", "llama-3.1-70b", "--layers", "40")
    assert (r["model"]["layers"], r["model"]["kv_heads"], r["model"]["head_size"]) == (40, 8, 128)
    assert "modified" in r["model"]["name"]
    # Overrides equal to the preset's numbers leave it the preset (review: "(modified)").
    r = run_json("plan", "--model", "llama-3.1-70b", "--layers", "80", "--kv-heads", "8")
    assert r["model"]["name"] == "llama-3.1-70b"
    # All three numbers with a preset: the preset modified, not a custom geometry (mutation testing).
    r = run_json("plan", "--model", "llama-3.1-70b", "--layers", "40", "--kv-heads", "4", "--head-size", "64")
    assert r["model"]["name"] == "llama-3.1-70b (modified)"

    # Defaults: llama-3.1-8b, 80 GiB x 0.9, no weights.
    r = run_json("plan")
    assert r["model"]["name"] == "llama-3.1-8b"
    assert r["kv_budget_bytes"] == 72 * 1073741824


def test_plan_table_output():
    rc, out, _err = run("plan", "--memory", "80GiB", "--utilization", "0.9", "--weights", "16GiB")
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("format"))
    assert set(lines[header + 1]) <= {"-", " "}
    rows = {line.split()[0]: line.split() for line in lines[header + 2 : header + 5]}
    assert rows["nvfp4"][1:] == ["589,824", "36,864", "101,944", "1,631,104", "199", "3.56x"]
    assert rows["bf16"][-1] == "1.00x" and rows["fp8"][-1] == "2.00x"
    assert "56.00 GiB for the KV cache" in out
    assert "no weights subtracted" not in out
    # Without --weights the whole budget goes to the cache, which no model leaves: said under the
    # budget (a CLI review: a 70B model "fit" 838,848 tokens on 80 GiB).
    rc, out, _err = run("plan", "--model", "llama-3.1-70b")
    assert rc == 0 and "- 0 B weights" in out and "no weights subtracted: pass --weights" in out


def test_plan_notes_a_block_size_that_vllm_scales_cannot_take():
    """vLLM's V-scale layout interleaves 4 tokens: a block size not divisible by 4 plans fine,
    but the default store then refuses it; the plan says so (review: it planned silently)."""
    for bs, noted in ((3, True), (17, True), (16, False), (4, False)):
        rc, out, _err = run("plan", "--memory", "80GiB", "--block-size", str(bs))
        assert rc == 0
        assert (f"note: block size {bs}: vLLM's scale layout" in out) is noted, out


def test_negative_sizes_are_named_as_negative():
    """`--memory -5GB` reached argparse as an option ("expected one argument"); now the size's own
    check names it, written apart or attached (review)."""
    for argv in (("--memory", "-5GB"), ("--memory=-5GB",), ("--weights", "-1GB"), ("--weights", "-.5GiB")):
        rc, out, err = run("plan", *argv)
        assert rc == 2 and out == "" and "a size cannot be negative" in err, (argv, err)
        assert err.count("\n") == 1
    rc, _, err = run("plan", "--utilization", "-0.5")
    assert rc == 2 and "is not in (0, 1]" in err
    rc, _, err = run("plan", "--memory", "--json")  # a missing value is still argparse's error
    assert rc == 2 and "expected one argument" in err


def test_flags_take_no_attached_value():
    """`--json -5` was attached as `--json=-5` (argparse: "ignored explicit argument"); a flag
    takes no value, so -5 is an unrecognized argument (review)."""
    for argv in (("plan", "--json", "-5"), ("plan", "--list-models", "-5"), ("--json", "-5")):
        rc, out, err = run(*argv)
        assert rc == 2 and out == "" and "unrecognized arguments: -5" in err, (argv, err)


def test_repeated_quiet_and_a_leading_double_dash():
    """`-qq plan` was refused as an option of plan's given before it, `-- plan` as options plan
    does not take (review)."""
    want = run("plan", "--json")
    assert want[0] == 0
    for argv in (("-qq", "plan", "--json"), ("--", "plan", "--json"), ("plan", "-qq", "--json"),
                 ("--json", "--", "plan"), ("plan", "--json", "--")):
        assert run(*argv) == want, argv


def test_list_models_refuses_options_it_would_ignore():
    """`plan --list-models --memory 80GB` listed the presets and ignored --memory (review); an
    option at its default value, --json and -q are fine."""
    rc, out, err = run("plan", "--list-models", "--memory", "80GB", "--model", "qwen3-8b")
    assert rc == 2 and out == "" and "--list-models takes no other options" in err
    assert "--memory" in err and "--model" in err and err.count("\n") == 1
    for given in (("--memory", "80GiB"), ("--model", "llama-3.1-8b"), ("--block-size", "16")):
        rc, out, _ = run("plan", "--list-models", *given, "-q")
        assert rc == 0 and "llama-3.1-8b" in out, given


def test_plan_notes_why_vs_bf16_has_no_value():
    """A budget below one bf16 page: 'vs bf16' is n/a, and a note says why (review: the column
    read n/a for formats that fit pages, unexplained)."""
    rc, out, _ = run("plan", "--memory", "40KB", "--utilization", "1", "--layers", "1", "--kv-heads", "8",
                     "--head-size", "128")
    assert rc == 0 and "n/a" in out and "not one bf16 page fits" in out
    rc, out, _ = run("plan")
    assert rc == 0 and "not one bf16 page fits" not in out


def test_model_presets():
    # Published config.json values (num_hidden_layers, num_key_value_heads, head_dim).
    expected = {
        "llama-3.1-8b": (32, 8, 128),
        "llama-3.1-70b": (80, 8, 128),
        "qwen2.5-7b": (28, 4, 128),
        "qwen2.5-72b": (80, 8, 128),
        "qwen3-8b": (36, 8, 128),
        "qwen3-32b": (64, 8, 128),
        "mistral-7b": (32, 8, 128),
        "gemma-2-9b": (42, 8, 256),
        "gemma-2-27b": (46, 16, 128),
        "mixtral-8x7b": (32, 8, 128),
    }
    assert {n: (m.layers, m.kv_heads, m.head_size) for n, m in MODELS.items()} == expected

    rc, out, _ = run("plan", "--list-models")
    assert rc == 0
    for name in expected:
        assert name in out
    models = run_json("plan", "--list-models")["models"]
    assert {m["name"]: (m["layers"], m["kv_heads"], m["head_size"]) for m in models} == expected


def test_model_names_and_custom_geometry():
    """Mutation testing: a preset is found whatever its case and the blanks around it, and without
    a preset every one of the three numbers is asked for by its flag."""
    from nvfp4kv.models import custom_geometry

    assert run_json("plan", "--model", " Llama-3.1-8B ")["model"]["name"] == "llama-3.1-8b"
    for given, missing in (((None, 8, 128), "--layers"), ((32, None, 128), "--kv-heads"), ((32, 8, None), "--head-size")):
        with pytest.raises(ValueError, match=f"without --model, give {missing}$"):
            custom_geometry(None, *given)


# --------------------------------------------------------------------------------------- info
def test_info():
    import nvfp4kv

    rc, out, _err = run("info")
    assert rc == 0
    assert nvfp4kv.__version__ in out and "CUDA kernels built" in out
    info = nvfp4kv.build_info()
    if not info["cuda_available"]:  # the reason is shown (mutation testing)
        assert re.search(r"^why not +" + re.escape(info["cuda_unavailable_reason"]) + "$", out, re.M), out
    r = run_json("info")
    assert r["nvfp4kv"] == nvfp4kv.__version__
    assert r["build"] == nvfp4kv.build_info()
    assert r["library"] == nvfp4kv.get_library() and r["library"] in out
    assert set(r) >= {"python", "platform", "numpy", "torch", "torch_cuda", "devices"}
    assert isinstance(r["devices"], list)


# --------------------------------------------------------------------------------------- demo
@pytest.fixture(scope="module")
def demo_result():
    rc, out, err = run("demo", "--tokens", "256", "--device", "cpu", "--json")
    assert rc == 0, err
    return json.loads(out)


def test_demo_json_schema(demo_result):
    r = demo_result
    assert r["command"] == "demo" and r["device"] == "cpu" and r["tokens"] == 256
    assert (
        r["model"]["layers"],
        r["model"]["kv_heads"],
        r["model"]["head_size"],
        r["block_size"],
    ) == (32, 8, 128, 16)
    assert r["pages"] * 16 >= 256
    assert r["k_scale"] > 0 and r["v_scale"] > 0
    f = {x["name"]: x for x in r["formats"]}
    assert list(f) == ["bf16", "fp8", "nvfp4", "nvfp4_4over6"]
    assert f["bf16"]["page_bytes_per_layer"] == 65536
    assert f["fp8"]["page_bytes_per_layer"] == 32768
    assert f["nvfp4"]["page_bytes_per_layer"] == f["nvfp4_4over6"]["page_bytes_per_layer"] == 18432
    assert f["nvfp4"]["page_bytes"] == 32 * 18432
    assert f["nvfp4"]["bytes_per_token"] == 36864
    assert f["nvfp4"]["gain_vs_bf16"] == pytest.approx(65536 / 18432)  # 3.56
    assert f["nvfp4"]["gain_vs_fp8"] == pytest.approx(32768 / 18432)  # 1.78
    assert [x["recipe"] for x in r["recipes"]] == ["nvfp4", "nvfp4_4over6"]
    for x in r["recipes"]:
        assert set(x["k"]) == set(x["v"]) == {"rel_l2", "cosine_mean", "cosine_min"}
        d = x["default_scales"]
        assert set(d) == {"k", "v"}
        assert set(d["k"]) == set(d["v"]) == {"rel_l2", "cosine_mean", "cosine_min"}
        s = x["store"]
        assert s["seconds_per_call"] > 0 and s["calls"] >= 3
        assert s["tokens_per_s"] == pytest.approx(256 / s["seconds_per_call"])
        # K and V read (bf16 with torch, float32 with numpy alone), both sides' NVFP4 rows written,
        # an int64 slot read (mutation testing)
        elem = {"bfloat16": 2, "float32": 4}[r["input_dtype"]]
        assert s["bytes_per_call"] == 256 * (2 * 8 * 128 * elem + 2 * 8 * 72 + 8)
        assert s["GBps"] == pytest.approx(s["bytes_per_call"] / s["seconds_per_call"] / 1e9)


def test_demo_scale_comparison_schema(demo_result):
    c = demo_result["scale_comparison"]
    assert c["used"] == "calibrated"
    assert c["calibrated"] == {"k_scale": demo_result["k_scale"], "v_scale": demo_result["v_scale"]}
    assert c["default"] == {"k_scale": 1.0, "v_scale": 1.0}
    # Group amaxes whose E4M3 scale amax/(6 g) is normal for g = 1: 6 * 2^-6 .. 6 * 448.
    assert c["default_window"] == [0.09375, 2688.0]
    for side in ("k", "v"):
        for which in ("calibrated", "default"):
            g = c["groups"][side][which]
            assert set(g) == {"subnormal", "zero", "saturated"}
            assert all(0.0 <= v <= 1.0 for v in g.values()) and sum(g.values()) <= 1.0
        # amax/448 puts the largest group at scale 448/6: nothing saturates, nothing vanishes.
        assert c["groups"][side]["calibrated"]["saturated"] == 0.0
    assert "amax/448" in c["note"] and "1.0" in c["note"]


def test_demo_default_scale_errors(demo_result):
    # This batch's magnitudes (|K| up to ~1e3, |V| up to ~1e2, few groups below 0.09) lie inside
    # the window where 1.0 keeps full precision, so the default costs little here: the demo
    # reports it rather than claiming a loss. Both are in the range of the calibrated error.
    for x in demo_result["recipes"]:
        for side in ("k", "v"):
            cal, dft = x[side]["rel_l2"], x["default_scales"][side]["rel_l2"]
            assert 0.03 < dft < 0.2, (x["recipe"], side, dft)
            assert dft < 1.5 * cal, (x["recipe"], side, dft, cal)


def test_demo_group_stats_and_window_by_hand():
    import numpy as np
    from nvfp4kv.cli import demo

    assert demo._full_precision_window(1.0) == (0.09375, 2688.0)
    assert demo._decode_scale(448.0) == 1.0
    groups = np.zeros((4, 16), np.float32)
    groups[0, 3] = 1.0  # amax/6 = 0.167: normal
    groups[1, 0] = 0.03  # 0.005: subnormal (< 2^-6), not zero (> 2^-10)
    groups[2, 5] = -0.005  # 0.00083 <= 2^-10: scale byte 0, reads back as zeros
    groups[3, 9] = 3000.0  # 500 > 448: saturated
    for torch in (None, pytest.importorskip("torch")):
        x = groups if torch is None else torch.from_numpy(groups)
        assert demo._group_stats(x, 1.0, torch) == {
            "subnormal": 0.25,
            "zero": 0.25,
            "saturated": 0.25,
        }
        # Calibrated g = 3000/448: the largest group's scale is 448/6, the 1.0 group's 0.025
        # (normal), the two small groups' scales round to zero.
        assert demo._group_stats(x, 3000.0 / 448, torch) == {
            "subnormal": 0.0,
            "zero": 0.5,
            "saturated": 0.0,
        }
        # A scale of exactly 2^-10 (amax 6 * 2^-10 at g = 1) is the tie between 0 and E4M3's
        # smallest subnormal, and rounds to 0: zero, not subnormal (mutation testing).
        tie = np.full((1, 16), 6 * 2.0**-10, np.float32)
        assert demo._group_stats(tie if torch is None else torch.from_numpy(tie), 1.0, torch) == {
            "subnormal": 0.0,
            "zero": 1.0,
            "saturated": 0.0,
        }


def test_demo_errors_in_a_sane_range(demo_result):
    rec = {x["recipe"]: x for x in demo_result["recipes"]}
    for side in ("k", "v"):
        e6 = rec["nvfp4"][side]["rel_l2"]
        e46 = rec["nvfp4_4over6"][side]["rel_l2"]
        assert 0.05 < e6 < 0.2, (side, e6)
        assert e46 <= 1.1 * e6, (side, e46, e6)
        for x in rec.values():
            assert 0.97 < x[side]["cosine_mean"] <= 1.0


def test_demo_counts_one_token_in_the_singular():
    """Found by review: "1 tokens" in the demo's lines."""
    rc, out, err = run("demo", "--tokens", "1", "--device", "cpu", "--backend", "numpy")
    assert rc == 0, err
    assert "batch:   1 token of one layer at random slots in 2 pages," in out
    assert "one layer, 1 token:" in out and "generating 1 token of K and V" in err
    assert "1 tokens" not in out + err and "1 pages" not in out + err


def test_demo_numpy_backend_and_table():
    rc, out, err = run("demo", "--tokens", "128", "--device", "cpu", "--backend", "numpy", "-q")
    assert rc == 0, err
    assert err == ""  # --quiet
    assert "numpy" in out and "float32 input" in out
    for word in ("bf16", "fp8", "nvfp4_4over6", "3.56x", "1.78x", "K rel L2", "GB/s"):
        assert word in out
    # The calibrated scales next to the engines' default 1.0, and one line on which is used.
    scales = out[out.index("Global scales") :]
    lines = scales.splitlines()
    cal = next(line for line in lines if line.startswith("calibrated amax/448 (used)"))
    dft = next(line for line in lines if line.startswith("default (no KV scales)"))
    assert dft.split()[4:6] == ["1.0", "1.0"]
    assert (len(cal.split()), len(dft.split())) == (3 + 2 + 4, 4 + 2 + 4)  # label, scales, errors
    assert "used: calibrated, amax/448. Engines use 1.0 when a checkpoint has no KV scales" in out
    assert "[0.0938, 2688]" in out and "groups of this batch outside it: K " in out
    accuracy = out[out.index("Accuracy") :]
    row = next(line for line in accuracy.splitlines() if line.startswith("nvfp4 "))
    rel_k = float(row.split()[1])
    assert 0.05 < rel_k < 0.2


def test_demo_with_no_arguments_in_subprocess():
    # What a user types first: `python -m nvfp4kv` (= `nvfp4kv demo`), default size.
    p = python_m()
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "demo: llama-3.1-8b geometry" in p.stdout
    assert "nvfp4_4over6" in p.stdout and "3.56x" in p.stdout


def test_plan_json_in_subprocess():
    p = python_m("plan", "--model", "qwen3-32b", "--memory", "141GB", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["model"]["layers"] == 64
    assert _by_name(r)["nvfp4"]["page_bytes"] == 64 * 18432


def test_console_script_if_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "nvfp4kv")
    if not os.path.exists(exe):
        pytest.skip("no nvfp4kv console script next to this Python")
    p = subprocess.run(
        [exe, "info", "--json"], check=False, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["command"] == "info"


def test_console_script_entry_point_resolves_to_cli_main():
    # pyproject.toml's [project.scripts] nvfp4kv = "nvfp4kv.cli:main", as installed.
    from importlib.metadata import entry_points

    eps = entry_points()
    scripts = eps.select(group="console_scripts") if hasattr(eps, "select") else eps["console_scripts"]
    ep = [e for e in scripts if e.name == "nvfp4kv"]
    if not ep:
        pytest.skip("nvfp4kv is not installed with its metadata")
    assert ep[0].value == "nvfp4kv.cli:main"
    assert ep[0].load() is cli.main


def test_cli_package_names_and_python_m_cli():
    # The names the command's package keeps at nvfp4kv.cli, whichever module defines them.
    for name in ("main", "build_parser", "CLIError", "parse_size", "plan_capacity", "run_demo",
                 "collect_info"):
        assert callable(getattr(cli, name)), name
    assert issubclass(cli.CLIError, Exception)
    p = subprocess.run([sys.executable, "-m", "nvfp4kv.cli", "plan", "--list-models"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == run("plan", "--list-models")[1]


def test_subcommand_options_before_the_subcommand_are_named():
    """Found by review: `nvfp4kv --seed 5 plan` said "invalid choice: '5'"."""
    rc, out, err = run("--seed", "5", "demo")
    assert rc == 2 and out == ""
    assert err == ("nvfp4kv: error: --seed 5: a subcommand's options go after it (nvfp4kv demo --seed 5) "
                   "(see 'nvfp4kv --help')\n"), err
    # Found by review: the same hint named `plan --seed 5`, which plan refuses.
    rc, out, err = run("--seed", "5", "plan")
    assert rc == 2 and out == ""
    assert err == "nvfp4kv plan: error: --seed 5: plan does not take these options (see 'nvfp4kv plan --help')\n", err
    rc, out, _ = run("--json", "-q", "plan")  # the common options still may
    assert rc == 0 and out.startswith("{")



def test_plan_and_info_json_keys_are_the_documented_ones():
    """python-api.md lists the keys of `plan --json`, `plan --list-models --json` and `info --json`
    (a CLI review: only demo's were documented); the lists and the output agree."""
    page = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python-api.md")
    if not os.path.isfile(page):
        pytest.skip("needs the source tree's docs/")
    text = " ".join(open(page, encoding="utf-8").read().split())
    para = re.search(r"The JSON of `plan` has the keys (.*?)\. The JSON of `info` has (.*?)\.(?: |$)", text)

    def names(s):
        return re.findall(r"`(\w+)`", s)

    rc, out, _err = run("plan", "--json")
    assert rc == 0
    r = json.loads(out)
    top, per_format = para.group(1).split("`formats` (per format:")
    documented = names(top)
    assert documented[:7] == ["command", "model", "name", "hf_id", "layers", "kv_heads", "head_size"]
    model_keys = documented[2:8]
    assert set(r) == {k for k in documented if k not in model_keys} | {"formats"}
    assert list(r["model"]) == model_keys
    fmt_keys = set(names(per_format.split("; with `--list-models`")[0])) - {"bf16"}  # "over bf16's"
    assert set(r["formats"][0]) == fmt_keys
    rc, out, _err = run("plan", "--list-models", "--json")
    assert rc == 0 and set(json.loads(out)) == {"command", "models"}
    assert list(json.loads(out)["models"][0]) == model_keys
    rc, out, _err = run("info", "--json")
    assert rc == 0
    assert set(json.loads(out)) == set(names(para.group(2))) - {"build_info"}
