"""The benchmark's timing helpers (python/nvfp4kv/bench.py) on a scripted stand-in for torch.cuda,
so the logic that decides which samples count runs without a GPU."""

import io
import json
import sys

import pytest
from nvfp4kv import bench
from nvfp4kv.progress import Progress


class FakeCuda:
    """Events whose elapsed time and 'reached' state follow a script, and a spin that records its
    cycles. `reached[i]` is what start.query() answers on attempt i (True: the GPU got to the
    start event before the host finished queueing, so the sample must not count)."""

    def __init__(self, reached, elapsed_ms):
        self.reached = list(reached)
        self.elapsed_ms = list(elapsed_ms)
        self.spins = []
        self.calls = 0
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                pass

            def query(self):
                return cuda.reached.pop(0)

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return cuda.elapsed_ms.pop(0)

        self.Event = Event

    def _sleep(self, cycles):
        self.spins.append(cycles)


class FakeTorch:
    def __init__(self, cuda):
        self.cuda = cuda


def test_queued_samples_count_only_when_the_host_was_ahead():
    cuda = FakeCuda(reached=[True, True, False, False, False], elapsed_ms=[0.010, 0.030, 0.020])
    calls = []
    us = bench._queued_per_call(FakeTorch(cuda), lambda: calls.append(1), calls=10, repeats=3)
    # Two rejected attempts double the spin twice; three samples of 1, 3, 2 us per call.
    assert cuda.spins == [1 << 20, 1 << 21, 1 << 22, 1 << 22, 1 << 22]
    assert len(calls) == 50
    assert us == pytest.approx(2.0)


def test_queued_gives_up_when_the_host_never_gets_ahead():
    cuda = FakeCuda(reached=[True] * 100, elapsed_ms=[])
    with pytest.raises(RuntimeError, match="cannot queue"):
        bench._queued_per_call(FakeTorch(cuda), lambda: None, calls=1, repeats=1)
    assert cuda.spins[-1] == 1 << 34


def test_table_shows_both_times():
    row = dict(tokens=1, H=8, D=128, dtype="bfloat16", layout="HND", recipe="nvfp4", us=5.0, launch_us=4.0,
               gpu_us=2.5, GBps=1.0, GBps_gpu=2.0, frac_copy=0.25, frac_copy_gpu=0.5, x_launch=1.25,
               graph_us=1.75, frac_size_copy=0.8)
    grow = dict(tokens=4096, seqs=8, H=8, D=128, us=9.0, gpu_us=6.0, GBps_gpu=3500.0,
                frac_copy=0.5, frac_copy_gpu=0.75, frac_size_copy=0.9)
    text = bench.format_table({"gpu": "X", "nvfp4kv": "0", "torch": "0", "store": [row], "gather": [grow],
                               "ceilings": {"copy_GBps": 4000.0, "empty_launch_us": 4.0,
                                            "empty_graph_node_us": 0.5}})
    store_line = next(line for line in text.splitlines() if line.lstrip().startswith("1 "))
    assert store_line.split()[6:] == ["5.00", "25.0%", "1.25", "4.00", "2.50", "2", "50.0%", "80.0%", "1.75"]
    gather_line = text.splitlines()[-1].split()
    assert gather_line[4:] == ["9.00", "50.0%", "6.00", "3500", "75.0%", "90.0%"]


def test_paired_samples_alternate():
    cuda = FakeCuda(reached=[], elapsed_ms=[0.003, 0.006, 0.009, 0.012])
    order = []
    a, b = bench._medians_per_call(FakeTorch(cuda), [lambda: order.append("a"), lambda: order.append("b")],
                                   calls=3, repeats=2)
    assert "".join(order) == "aaabbbaaabbb"
    assert (a, b) == (pytest.approx(2.0), pytest.approx(3.0))


def test_write_json_is_whole_or_nothing(tmp_path):
    path = tmp_path / "r.json"
    bench.write_json(str(path), {"a": 1})
    assert path.read_text().replace(" ", "").replace("\n", "") == '{"a":1}'
    with pytest.raises(TypeError):  # fails part way through the dump
        bench.write_json(str(path), {"a": 2, "b": object()})
    assert path.read_text().replace(" ", "").replace("\n", "") == '{"a":1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left


def test_write_json_new_file_only(tmp_path):
    """Found by review: --output was checked when parsed, and a file made while the benchmark ran
    was then replaced; the file also came out 0600. replace=False (what the CLI passes) refuses
    an existing path at the write itself and leaves it as it was."""
    path = tmp_path / "r.json"
    bench.write_json(str(path), {"a": 1}, replace=False)
    assert json.loads(path.read_text()) == {"a": 1}
    assert path.stat().st_mode & 0o777 == 0o666 & ~bench._umask()
    with pytest.raises(FileExistsError):
        bench.write_json(str(path), {"a": 2}, replace=False)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_write_json_without_hard_links_leaves_no_partial_file(tmp_path, monkeypatch):
    """Found by review: where os.link fails (a file system without hard links) the file is created
    exclusively and written; a write that failed there (a full disk) left a partial file."""
    import builtins
    import errno

    def no_link(src, dst):
        raise OSError(errno.EPERM, "no hard links here")

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def opener(file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        return FullDisk(f) if "x" in mode else f

    monkeypatch.setattr(bench.os, "link", no_link)
    path = tmp_path / "r.json"
    bench.write_json(str(path), {"a": 1}, replace=False)  # the fallback itself works
    assert json.loads(path.read_text()) == {"a": 1}
    path.unlink()
    monkeypatch.setattr(bench, "open", opener, raising=False)
    with pytest.raises(OSError, match="No space"):
        bench.write_json(str(path), {"a": 1}, replace=False)
    assert list(tmp_path.iterdir()) == []  # neither the partial file nor the temporary one


def test_progress_writes_whole_lines_off_a_terminal(capsys):
    # Captured stderr is not a terminal: every status is its own line, with no carriage return
    # or escape sequence that a log file or CI output would keep as garbage.
    status = Progress("[p] ")
    status("[1/2] first")
    status("[2/2] second")
    status.done("2 cases")
    assert capsys.readouterr().err == "[p] [1/2] first\n[p] [2/2] second\n[p] 2 cases\n"
    quiet = Progress(enabled=False)
    quiet("x")
    quiet.done("y")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("term, rewrites", [("xterm-256color", True), ("dumb", False)])
def test_progress_on_a_terminal(monkeypatch, term, rewrites):
    """On a terminal each status rewrites the last; a TERM=dumb terminal has no erase-line
    control, so it gets whole lines as a log does (review)."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("TERM", term)
    status = Progress()
    status("a")
    status.done("b")
    assert err.getvalue() == ("\r\033[Ka\r\033[Kb\n" if rewrites else "a\nb\n")


def test_json_path_is_checked_before_a_run(tmp_path):
    """Found by review: the benchmark scripts wrote --json after the run, so a bad path lost the
    results with a traceback; now refused when parsed, and existing files may be replaced."""
    assert bench.check_json_path(str(tmp_path / "r.json"), new=True)
    (tmp_path / "r.json").write_text("{}")
    assert bench.check_json_path(str(tmp_path / "r.json"), new=False)
    for path, needle, new in [(str(tmp_path / "r.json"), "exists", True), (str(tmp_path), "is a directory", False),
                              (str(tmp_path / "no" / "r.json"), "does not exist", False), (" ", "empty", False),
                              # review: a trailing slash passed (abspath drops it), then the write failed
                              (str(tmp_path / "nodir") + "/", "names a directory", True),
                              (str(tmp_path / "r.json") + "/", "names a directory", False)]:
        with pytest.raises(ValueError, match=needle):
            bench.check_json_path(path, new=new)
    with pytest.raises(SystemExit) as e:
        bench.main(["--json", str(tmp_path / "no" / "r.json")])
    assert e.value.code == 2
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the probe left nothing
