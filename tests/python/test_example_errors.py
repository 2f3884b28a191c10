"""The examples (examples/decode_loop.py, examples/sdpa_prefill.py) when their sizes exceed the
machine: one line naming the sizes to lower and status 1, not a traceback; any other error keeps
its traceback."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("nvfp4kv")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")

# (script, the sizes its line names, arguments whose buffers exceed a 64-bit address space: 10^16
# and 10^17 bytes of CPU memory, refused at once whatever the kernel's overcommit policy)
SCRIPTS = [
    ("decode_loop.py", "(--batch, --prompt-len, --steps)", ["--batch", "100000", "--prompt-len", "100000000"]),
    ("sdpa_prefill.py", "(--seq-lens, --heads)", ["--seq-lens", "100000000000000"]),
]
IDS = [s[0] for s in SCRIPTS]


def run(script, argv, raised=None):
    """The example run as a script (its __main__ block) in a new interpreter on the CPU; with
    `raised` (Python source of an exception), torch.randn raises it."""
    path = os.path.join(EXAMPLES, script)
    patch = f"def fail(*args, **kwargs):\n    raise {raised}\ntorch.randn = fail\n" if raised else ""
    code = (f"import runpy, sys, torch\n{patch}"
            f"sys.argv = [{path!r}, '--device', 'cpu'] + {list(argv)!r}\n"
            f"runpy.run_path({path!r}, run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def error_line(done):
    """The script's line: the last of stderr (a sanitizer's warnings may come first: CI runs the
    tests under ASan, which reports the failed allocation)."""
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr.splitlines()[-1]


@pytest.mark.parametrize("script, sizes, huge", SCRIPTS, ids=IDS)
def test_sizes_past_the_memory(script, sizes, huge):
    line = error_line(run(script, huge))
    assert re.fullmatch(rf"{re.escape(script)}: error: out of memory \(.*allocate.*\); try smaller sizes "
                        rf"{re.escape(sizes)}", line), line


@pytest.mark.parametrize("raised, shown", [
    ("torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')", "CUDA out of memory. Tried"),
    ("MemoryError()", "MemoryError"),  # Python's, often without a message
    ("RuntimeError('Storage size calculation overflowed with sizes=[1, 2]')", "Storage size calculation"),
])
@pytest.mark.parametrize("script, sizes, huge", SCRIPTS, ids=IDS)
def test_each_kind_of_out_of_memory(script, sizes, huge, raised, shown):
    line = error_line(run(script, [], raised))
    assert line.startswith(f"{script}: error: out of memory ({shown}"), line
    assert line.endswith(f"; try smaller sizes {sizes}"), line


@pytest.mark.parametrize("script, sizes, huge", SCRIPTS, ids=IDS)
def test_other_errors_keep_their_traceback(script, sizes, huge):
    done = run(script, [], "RuntimeError('a bug, not a size')")
    assert done.returncode == 1 and "Traceback" in done.stderr and "a bug, not a size" in done.stderr
    assert "out of memory" not in done.stderr
