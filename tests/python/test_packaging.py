"""The installed package as a distribution: one version everywhere, the C/C++ files it carries,
the library's name (its SONAME) and the symbols it exports.

Meant to run against an installed wheel (.ci/run, cibuildwheel), also fine in an editable
install. Nothing here needs a GPU.
"""
import ctypes
import importlib
import importlib.metadata
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest

nvfp4kv = pytest.importorskip("nvfp4kv")
paths = importlib.import_module("nvfp4kv.paths")

# The distributions that provide the import package `nvfp4kv`: a source build, and the two wheel
# variants of .github/workflows/wheels.yml.
DIST_NAMES = ("nvfp4kv", "nvfp4kv-cu12", "nvfp4kv-cu13")
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_HEADER = os.path.join(HERE, "..", "..", "cpp", "include", "nvfp4kv", "nvfp4kv.h")


def installed_distribution():
    """The one installed distribution that provides `nvfp4kv` (skips when it runs from a tree)."""
    found = []
    for name in DIST_NAMES:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        files = [str(f).replace("\\", "/") for f in (dist.files or ())]
        if any(f.startswith("nvfp4kv/") for f in files):
            found.append(dist)
    if not found:
        pytest.skip("nvfp4kv is not installed as a distribution (imported from a source tree)")
    names = sorted(d.metadata["Name"] for d in found)
    assert len(found) == 1, f"several distributions provide `nvfp4kv` and overwrite each other: {names}"
    return found[0]


def header_version(path):
    text = open(path).read()
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^#define NVFP4KV_VERSION_{part} (\d+)$", text, re.M)
        assert m, f"NVFP4KV_VERSION_{part} not found in {path}"
        parts.append(int(m.group(1)))
    return "{}.{}.{}".format(*parts)


def cmake_package_version():
    text = open(os.path.join(paths.cmake_dir(), "nvfp4kvConfigVersion.cmake")).read()
    m = re.search(r'set\(PACKAGE_VERSION "([^"]+)"\)', text)
    assert m, "PACKAGE_VERSION not set in nvfp4kvConfigVersion.cmake"
    return m.group(1)


def elf_dynamic(path):
    """The strings of an ELF file's dynamic section: {"NEEDED": [...], "SONAME": [...],
    "RPATH": [...], "RUNPATH": [...]}. A few lines of struct, so that the checks need neither
    binutils nor pyelftools."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF", f"{path} is not an ELF file"
    end = "<" if data[5] == 1 else ">"
    if data[4] == 2:  # ELFCLASS64
        (shoff,) = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        section, entry = end + "IIQQQQIIQQ", end + "qQ"
    else:
        (shoff,) = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        section, entry = end + "10I", end + "iI"
    # (name, type, flags, addr, offset, size, link, ...): .dynamic is type 6, its strings the
    # section that sh_link names.
    sections = [struct.unpack_from(section, data, shoff + i * shentsize) for i in range(shnum)]
    dynamic = [s for s in sections if s[1] == 6]
    assert len(dynamic) == 1, f"{path} has {len(dynamic)} dynamic sections"
    _, _, _, _, offset, size, link = dynamic[0][:7]
    strings = sections[link][4]
    tags = {1: "NEEDED", 14: "SONAME", 15: "RPATH", 29: "RUNPATH"}
    found = {name: [] for name in tags.values()}
    for tag, value in struct.iter_unpack(entry, data[offset:offset + size]):
        if tag == 0:  # DT_NULL
            break
        if tag in tags:
            start = strings + value
            found[tags[tag]].append(data[start:data.index(b"\0", start)].decode())
    return found


needs_elf = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF (Linux) only")


@pytest.fixture(scope="module")
def library():
    """The installed library through ctypes (the file nvfp4kv._C loads, unless LD_LIBRARY_PATH
    names another)."""
    lib = ctypes.CDLL(paths.get_library())
    lib.nvfp4kv_version.restype = ctypes.c_int
    lib.nvfp4kv_version_string.restype = ctypes.c_char_p
    lib.nvfp4kv_cuda_built.restype = ctypes.c_int
    lib.nvfp4kv_cuda_build_version.restype = ctypes.c_int
    lib.nvfp4kv_cuda_archs.restype = ctypes.c_char_p
    return lib


def test_one_version_everywhere(library):
    dist = installed_distribution()
    version = nvfp4kv.__version__
    installed_header = os.path.join(paths.get_include(), "nvfp4kv", "nvfp4kv.h")
    seen = {
        "nvfp4kv.__version__ (compiled module)": version,
        f"importlib.metadata.version({dist.metadata['Name']!r})": dist.version,
        "installed nvfp4kv.h NVFP4KV_VERSION_*": header_version(installed_header),
        "installed nvfp4kvConfigVersion.cmake PACKAGE_VERSION": cmake_package_version(),
        "library nvfp4kv_version_string()": library.nvfp4kv_version_string().decode(),
    }
    if os.path.exists(SOURCE_HEADER):  # running from a checkout: the tree must agree as well
        seen["source cpp/include/nvfp4kv/nvfp4kv.h"] = header_version(SOURCE_HEADER)
    assert len(set(seen.values())) == 1, "versions disagree:\n" + "\n".join(
        f"  {k}: {v}" for k, v in seen.items())
    major, minor, patch = (int(x) for x in version.split("."))
    assert library.nvfp4kv_version() == major * 10000 + minor * 100 + patch


def test_wheel_variant_matches_its_cuda(library):
    """nvfp4kv-cu12 / nvfp4kv-cu13 must carry kernels built with that CUDA major version."""
    name = installed_distribution().metadata["Name"].lower()
    m = re.fullmatch(r"nvfp4kv-cu(\d+)", name)
    if not m:
        pytest.skip(f"{name} is not a CUDA wheel variant")
    if nvfp4kv.build_info()["cuda_option"] == "OFF":  # README: the override builds the CPU path
        assert library.nvfp4kv_cuda_built() == 0
        pytest.skip(f"{name} built with NVFP4KV_CUDA=OFF (the CPU path, as asked)")
    assert library.nvfp4kv_cuda_built() == 1, f"{name} was built without its CUDA kernels"
    built = library.nvfp4kv_cuda_build_version()
    assert built // 1000 == int(m.group(1)), f"{name} built with CUDA {built}"
    archs = library.nvfp4kv_cuda_archs().decode().split(",")
    for arch in ("80-real", "90-real", "100-real", "120-real", "120-virtual"):
        assert arch in archs, f"{name} lacks {arch}: {archs}"


def test_c_and_cmake_files_are_installed():
    include, libdir, cmake = paths.get_include(), paths.get_library_dir(), paths.cmake_dir()
    for header in ("nvfp4kv.h", "dlpack.h", "format.h"):
        assert os.path.isfile(os.path.join(include, "nvfp4kv", header)), header
    assert os.path.isfile(paths.get_library())
    assert os.path.dirname(paths.get_library()) == libdir
    for f in ("nvfp4kvConfig.cmake", "nvfp4kvConfigVersion.cmake", "nvfp4kvTargets.cmake"):
        assert os.path.isfile(os.path.join(cmake, f)), f
    # All three live beside the compiled extension (also in an editable install).
    ext_dir = os.path.dirname(os.path.abspath(importlib.import_module("nvfp4kv._C").__file__))
    for p in (include, libdir, cmake):
        assert os.path.commonpath([ext_dir, p]) == ext_dir, (p, ext_dir)


def test_cmake_package_points_at_existing_files():
    """nvfp4kvTargets*.cmake must name the include directory and library where they are (a
    relocated prefix such as <site-packages>/include would break every consumer)."""
    targets = os.path.join(paths.cmake_dir(), "nvfp4kvTargets.cmake")
    text = open(targets).read()
    # CMake computes _IMPORT_PREFIX by stripping one path component per get_filename_component.
    prefix = targets
    for _ in range(text.count('get_filename_component(_IMPORT_PREFIX "${')):
        prefix = os.path.dirname(prefix)
    for f in os.listdir(paths.cmake_dir()):
        if f.startswith("nvfp4kvTargets-"):
            text += open(os.path.join(paths.cmake_dir(), f)).read()
    named = re.findall(r'(?:INTERFACE_INCLUDE_DIRECTORIES|IMPORTED_LOCATION_\w+) "([^"]*)"', text)
    assert len(named) >= 2, text
    for entry in named:
        for p in entry.split(";"):
            resolved = os.path.normpath(p.replace("${_IMPORT_PREFIX}", prefix))
            assert os.path.exists(resolved), f"nvfp4kvTargets names {p} = {resolved}: missing"
    # A consumer records the SONAME and loads the file of that name at run time.
    sonames = re.findall(r'IMPORTED_SONAME_\w+ "([^"]*)"', text)
    assert sonames, text
    for soname in sonames:
        assert os.path.isfile(os.path.join(paths.get_library_dir(), soname)), soname


def abi_version():
    """MAJOR.MINOR: while the major version is 0 a minor release may change the ABI (the CMake
    package's SameMinorVersion), so the SONAME carries both."""
    major, minor, _ = nvfp4kv.__version__.split(".")
    return f"{major}.{minor}"


@needs_elf
def test_library_is_named_after_its_soname():
    """The SONAME carries the ABI version, so a program linked against 0.1 never loads 0.2; the
    one library file has the SONAME as its name (a wheel cannot hold the symlink that usually
    carries it)."""
    lib = paths.get_library()
    assert elf_dynamic(lib)["SONAME"] == [f"libnvfp4kv.so.{abi_version()}"], lib
    assert os.path.basename(lib) == f"libnvfp4kv.so.{abi_version()}"


@needs_elf
def test_extension_needs_the_file_beside_it():
    """nvfp4kv._C records the library by its SONAME (DT_NEEDED) and finds it through its run path
    ($ORIGIN/lib): a file of exactly that name must be there."""
    ext = os.path.abspath(importlib.import_module("nvfp4kv._C").__file__)
    dynamic = elf_dynamic(ext)
    needed = [n for n in dynamic["NEEDED"] if n.startswith("libnvfp4kv")]
    assert needed == [os.path.basename(paths.get_library())], dynamic["NEEDED"]
    run_path = [d.replace("$ORIGIN", os.path.dirname(ext))
                for entry in dynamic["RUNPATH"] + dynamic["RPATH"] for d in entry.split(":")]
    assert any(os.path.isfile(os.path.join(d, needed[0])) for d in run_path), (needed, run_path)


def test_library_is_one_file():
    """A wheel is a zip, which stores a symlink as one more copy: the library is there once, as
    one regular file, in the directory and in the distribution's RECORD."""
    lib = paths.get_library()
    found = sorted(f for f in os.listdir(paths.get_library_dir()) if f.startswith("libnvfp4kv"))
    assert found == [os.path.basename(lib)]
    assert not os.path.islink(lib)
    recorded = [str(f) for f in (installed_distribution().files or ())
                if os.path.basename(str(f)).startswith("libnvfp4kv")]
    assert recorded == ["nvfp4kv/lib/" + os.path.basename(lib)], recorded


def test_package_exports_the_path_helpers():
    missing = [n for n in paths.__all__ if not hasattr(nvfp4kv, n)]
    if missing:
        pytest.skip(f"nvfp4kv does not re-export {missing} yet")
    for name in paths.__all__:
        assert getattr(nvfp4kv, name) is getattr(paths, name)


C_API_DOC = os.path.join(HERE, "..", "..", "docs", "c-api.md")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.skipif(not os.path.exists(C_API_DOC), reason="needs the source tree's docs/")
def test_c_api_docs_prototypes_match_the_header(tmp_path):
    """Every prototype in docs/c-api.md's code blocks compiles as a redeclaration of the installed
    header's: a parameter the docs add, drop or retype is a conflicting-types error (found by
    review: store_with_workspace's was written as "the arguments of nvfp4kv_store, then ...")."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", open(C_API_DOC).read(), re.S)
    protos = [m.group(0) for b in blocks
              for m in re.finditer(r"^[A-Za-z_][\w\s*]*\bnvfp4kv_\w+\s*\([^;{]*\)\s*;", b, re.M)]
    names = {re.search(r"(nvfp4kv_\w+)\s*\(", p).group(1) for p in protos}
    assert {"nvfp4kv_store", "nvfp4kv_store_with_workspace", "nvfp4kv_decode_attention"} <= names, names
    src = tmp_path / "protos.c"
    src.write_text('#include "nvfp4kv/nvfp4kv.h"\n' + "\n".join(protos) + "\n")
    r = subprocess.run(["cc", "-std=c99", "-pedantic", "-Werror", "-fsyntax-only", "-I", paths.get_include(),
                        str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("compiler, std, suffix", [("cc", "c89", ".c"), ("cc", "c99", ".c"), ("c++", "c++98", ".cpp"),
                                                   ("c++", "c++17", ".cpp")])
def test_c_header_compiles_alone_under_old_standards(tmp_path, compiler, std, suffix):
    """The installed header as docs/c-api.md says it compiles: C89 and C++98 included (runtimes
    pinned to old standards), -pedantic, every warning an error."""
    if shutil.which(compiler) is None:
        pytest.skip(f"needs {compiler}")
    src = tmp_path / f"h{suffix}"
    src.write_text('#include "nvfp4kv/nvfp4kv.h"\nint main(void) { return nvfp4kv_version() > 0 ? 0 : 1; }\n')
    r = subprocess.run([compiler, f"-std={std}", "-pedantic", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I",
                        paths.get_include(), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_library_exports_only_the_c_abi():
    lib = paths.get_library()
    out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True,
                         text=True).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "nvfp4kv_store" in symbols and "nvfp4kv_dequantize" in symbols, symbols
    others = [s for s in symbols if not s.startswith("nvfp4kv_")]
    assert not others, f"{lib} exports symbols outside the C ABI: {others}"


def test_get_library_without_the_extensions_name(monkeypatch):
    # An extension built before LIBRARY_FILE existed (an editable install pulled without a
    # rebuild): the one library file in lib/ is found instead of an AttributeError.
    want = paths.get_library()
    real = paths.importlib.import_module
    monkeypatch.setattr(paths.importlib, "import_module",
                        lambda name, *a: object() if name.endswith("._C") else real(name, *a))
    assert paths.get_library() == want


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def test_cuda_call_without_a_usable_device_says_why(library):
    """A CUDA build where no device can be used (CI: no driver) names the reason that
    nvfp4kv_cuda_device_count gives, not only the runtime's "driver version is insufficient"
    (found by review). The tensors are described, never dereferenced: the call fails first."""
    if not library.nvfp4kv_cuda_built():
        pytest.skip("a build without CUDA answers NOT_SUPPORTED (tested in test_capi)")
    reason = ctypes.c_char_p()
    if library.nvfp4kv_cuda_device_count(ctypes.byref(reason)) > 0:
        pytest.skip("a usable CUDA device is present")
    library.nvfp4kv_last_error.restype = ctypes.c_char_p
    shape = (ctypes.c_int64 * 1)(4)
    one = (ctypes.c_int64 * 1)(1)
    kDLCUDA, kDLFloat = 2, 2
    x = DLTensor(0x10000, kDLCUDA, 0, 1, kDLFloat, 32, 1, shape, None, 0)
    out = DLTensor(0x20000, kDLCUDA, 0, 1, kDLFloat, 32, 1, one, None, 0)
    status = library.nvfp4kv_amax(ctypes.byref(x), ctypes.byref(out), 0, None)
    message = library.nvfp4kv_last_error().decode()
    assert status == 5, message  # NVFP4KV_ERROR_CUDA
    assert reason.value.decode() in message, (reason.value, message)
