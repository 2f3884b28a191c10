"""Where an installed nvfp4kv keeps its C/C++ side: headers, shared library, CMake package.

The wheel (and ``pip install .``) carries the same files as ``cmake --install``::

    nvfp4kv/include/nvfp4kv/nvfp4kv.h   the C ABI (plus dlpack.h, format.h)
    nvfp4kv/lib/libnvfp4kv.so.0.1       the library (CUDA runtime linked statically)
    nvfp4kv/lib/cmake/nvfp4kv/          nvfp4kvConfig.cmake, exporting nvfp4kv::nvfp4kv

but the library only once: a wheel (a zip) cannot hold the symlinks that ``cmake --install`` puts
beside it, so its one file is named after its SONAME, ``libnvfp4kv.so.MAJOR.MINOR`` (the ABI
version), and there is no ``libnvfp4kv.so`` for ``-lnvfp4kv``: link with ``get_library()``, as the
CMake package does. A C or C++ program builds against the wheel with::

    cmake -S . -B build -Dnvfp4kv_DIR="$(python -c 'import nvfp4kv; print(nvfp4kv.cmake_dir())')"

The paths are found next to the compiled extension module ``nvfp4kv._C``, not next to this file:
in an editable install (``pip install -e .``) the Python files stay in the source tree while the
compiled files, headers and CMake package are installed into site-packages.
"""

import importlib.util
import os

__all__ = ["cmake_dir", "get_include", "get_library", "get_library_dir"]

_EXTENSION = __name__.rpartition(".")[0] + "._C"


def _package_root():
    """The directory holding the compiled extension and, beside it, include/ and lib/."""
    spec = importlib.util.find_spec(_EXTENSION)
    if spec is None or not spec.origin:
        raise ImportError(f"{_EXTENSION} not found: nvfp4kv is not installed (pip install .)")
    return os.path.dirname(os.path.abspath(spec.origin))


def _existing(path, what):
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{what} not found at {path}: this nvfp4kv installation does not carry its C/C++ "
            "files (install the wheel or run `pip install .`; `cmake --install` puts them under "
            "its own prefix instead)")
    return path


def get_include():
    """Directory to put on the include path: it holds ``nvfp4kv/nvfp4kv.h``.

    Returns
    -------
    str
        Absolute path, e.g. ``.../site-packages/nvfp4kv/include``.
    """
    path = os.path.join(_package_root(), "include")
    _existing(os.path.join(path, "nvfp4kv", "nvfp4kv.h"), "nvfp4kv/nvfp4kv.h")
    return path


def get_library_dir():
    """Directory holding the shared library (``get_library()``): the run-time search path.

    Returns
    -------
    str
        Absolute path, e.g. ``.../site-packages/nvfp4kv/lib``.
    """
    return _existing(os.path.join(_package_root(), "lib"), "the nvfp4kv library directory")


def get_library():
    """The shared library the package carries, to link with or to load with ctypes. Its name is
    its SONAME, ``libnvfp4kv.so.MAJOR.MINOR``: the name the extension and every program linked
    against it record. (``LD_LIBRARY_PATH`` can make the loader take another file of that name.)

    Returns
    -------
    str
        Absolute path, e.g. ``.../site-packages/nvfp4kv/lib/libnvfp4kv.so.0.1``.
    """
    libdir = get_library_dir()
    try:  # the SONAME the build gave it
        name = importlib.import_module(_EXTENSION).LIBRARY_FILE
    except (ImportError, AttributeError):  # an extension built before it had the name
        found = sorted(f for f in os.listdir(libdir) if f.startswith("libnvfp4kv.so"))
        name = found[0] if len(found) == 1 else "libnvfp4kv.so.MAJOR.MINOR"
    return _existing(os.path.join(libdir, name), name)


def cmake_dir():
    """Directory of ``nvfp4kvConfig.cmake``: pass it as ``-Dnvfp4kv_DIR=...`` to CMake.

    Returns
    -------
    str
        Absolute path, e.g. ``.../site-packages/nvfp4kv/lib/cmake/nvfp4kv``.
    """
    path = os.path.join(_package_root(), "lib", "cmake", "nvfp4kv")
    _existing(os.path.join(path, "nvfp4kvConfig.cmake"), "nvfp4kvConfig.cmake")
    return path
