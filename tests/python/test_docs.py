"""The examples of the docs run and print what the docs say they print.

Every ```python block of the pages below that holds a `# -> value` comment is a complete script:
it is run (in this process, its own namespace) and the lines it prints are compared, in order,
with those comments: equal, or starting with the text before a closing "..." (a long message cut
short). A block followed by "prints (CPU):" and a fenced block (the README's quick start) is
compared with that block's lines, where no GPU would take the script's device. Text after two
spaces in a comment is an annotation, not output. Blocks that need a GPU run only where there is
one; blocks whose output says "(CPU build)" only on a build without CUDA;
blocks that name torch at all (some use it without importing it: `allocate_kv_cache`'s default
backend) only where torch is installed, and those that import it only with the torch the docs name
(python-api.md: "each was run with ... torch X"): their outputs follow from torch's random
numbers, which another version may draw differently (torch 2.11 on the H200 machine did).
The pages are read from the checkout; a copy of the tests without them (a wheel's test run
given only tests/python) skips these tests rather than failing to collect.
"""
import contextlib
import io
import os
import re

import pytest

import nvfp4kv

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PAGES = ("README.md", "docs/python-api.md", "docs/integration.md", "docs/scales.md")


def have_pages():
    return all(os.path.isfile(os.path.join(ROOT, page)) for page in PAGES)


def docs_torch():
    """The torch version the examples were run with, as python-api.md states it."""
    text = open(os.path.join(ROOT, "docs/python-api.md"), encoding="utf-8").read()
    return re.search(r"was run with.*?torch (\d+\.\d+\.\d+)", text, re.S).group(1)


def examples():
    """(page:line, code, output block or None) of every python block with at least one `# ->`
    comment or followed by a "prints (CPU):" output block."""
    found = []
    if not have_pages():
        return found
    for page in PAGES:
        lines = open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                code = "\n".join(lines[i + 1:j])
                after = [k for k in range(j + 1, min(j + 6, len(lines))) if lines[k].strip()]
                cpu_out = None
                if len(after) >= 2 and lines[after[0]].strip() == "prints (CPU):" and \
                        lines[after[1]].strip() == "```":
                    k = after[1] + 1
                    while lines[k].strip() != "```":
                        k += 1
                    cpu_out = lines[after[1] + 1:k]
                if "# ->" in code or cpu_out is not None:
                    found.append(pytest.param(code, cpu_out, id=f"{page}:{i + 2}"))
                i = j
            i += 1
    return found


def expected(code):
    """The printed lines the comments promise, in order (annotations after two spaces dropped)."""
    return [re.split(r"\s{2,}", m.group(1).strip())[0] for m in re.finditer(r"#\s*->\s*(.*)$", code, re.M)]


def matches(line, want):
    line = line.rstrip()
    return line == want or (want.endswith("...") and line.startswith(want[:-3].rstrip()))


def test_examples_found():
    if not have_pages():
        pytest.skip("README.md and docs/ are not next to these tests (a copy of tests/python only)")
    assert len(examples()) >= 30  # the pages' examples are found at all
    assert docs_torch() == "2.13.0"  # the version .ci/run pins


@pytest.mark.parametrize("code,cpu_out", examples())
def test_example_prints_what_the_docs_say(code, cpu_out):
    if re.search(r"device=\"cuda\"|\.cuda\(\)", code):
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
    if "(CPU build)" in code and nvfp4kv.build_info()["cuda_built"]:
        pytest.skip("prints what a build without CUDA prints")
    if re.search(r"\btorch\b", code):
        torch = pytest.importorskip("torch")
    if cpu_out is not None and nvfp4kv.build_info()["cuda_available"]:
        pytest.skip("prints what the script prints on the CPU; a GPU here takes its device")
    if "import torch" in code:
        if torch.__version__.split("+")[0] != docs_torch():
            pytest.skip(f"the examples print what torch {docs_torch()} draws; this is torch {torch.__version__}")
    threads = nvfp4kv.cpu_threads()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<docs example>", "exec"), {"__name__": "__docs_example__"})
    finally:
        nvfp4kv.set_cpu_threads(threads)
    printed = out.getvalue().rstrip("\n").split("\n") if out.getvalue() else []
    want = expected(code) if cpu_out is None else cpu_out
    assert len(printed) == len(want), (printed, want)
    for line, w in zip(printed, want):
        assert matches(line, w), (line, w)


@pytest.mark.skipif(not have_pages(), reason="needs the source tree's docs/")
def test_c_api_example_prints_what_the_docs_say(tmp_path):
    """docs/c-api.md's complete C program (the ```c block with main) compiles against the installed
    header and library and prints the lines the page shows after it ("prints"), its error message
    included (an integrator's review ran it by hand; a message changed since would have gone
    unnoticed)."""
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    text = open(os.path.join(ROOT, "docs/c-api.md"), encoding="utf-8").read()
    program = next(b for b in re.findall(r"```c\n(.*?)```", text, re.S) if "int main(void)" in b)
    shown = re.search(r"\nprints\n\n```\n(.*?)```", text[text.index(program):], re.S).group(1).splitlines()
    src = tmp_path / "example.c"
    src.write_text(program)
    lib = nvfp4kv.get_library()
    exe = tmp_path / "example"
    subprocess.run(["cc", "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I", nvfp4kv.get_include(),
                    str(src), lib, f"-Wl,-rpath,{os.path.dirname(lib)}", "-o", str(exe)], check=True)
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    want = [line.replace("0.1.0", nvfp4kv.__version__) for line in shown]
    assert got == want
