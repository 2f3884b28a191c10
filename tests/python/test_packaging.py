"""The installed package as a distribution: one version everywhere, the C/C++ files it carries,
the symbols its library exports.

Meant to run against an installed wheel (.ci/run, cibuildwheel), also fine in an editable
install. Nothing here needs a GPU.
"""
import ctypes
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess

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


@pytest.fixture(scope="module")
def library():
    """The installed libnvfp4kv.so through ctypes (the same object nvfp4kv._C has loaded)."""
    lib = ctypes.CDLL(os.path.join(paths.get_library_dir(), "libnvfp4kv.so"))
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
        "libnvfp4kv.so nvfp4kv_version_string()": library.nvfp4kv_version_string().decode(),
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
    assert os.path.isfile(os.path.join(libdir, "libnvfp4kv.so"))
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


def test_package_exports_the_path_helpers():
    missing = [n for n in paths.__all__ if not hasattr(nvfp4kv, n)]
    if missing:
        pytest.skip(f"nvfp4kv does not re-export {missing} yet")
    for name in paths.__all__:
        assert getattr(nvfp4kv, name) is getattr(paths, name)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_library_exports_only_the_c_abi():
    lib = os.path.join(paths.get_library_dir(), "libnvfp4kv.so")
    out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True,
                         text=True).stdout
    symbols = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "nvfp4kv_store" in symbols and "nvfp4kv_dequantize" in symbols, symbols
    others = [s for s in symbols if not s.startswith("nvfp4kv_")]
    assert not others, f"libnvfp4kv.so exports symbols outside the C ABI: {others}"
