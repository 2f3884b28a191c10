"""Work that waits for a module's import: the torch custom ops wait for torch, their tracing by
Dynamo waits for ``torch._dynamo`` (design notes: "torch.compile: the API traced as custom ops").

``import nvfp4kv`` imports no torch, and registering the ops imports no ``torch._dynamo`` (about a
second, which a program that never compiles need not pay). :func:`after_import` runs its callback at
once where the module is already imported (once another thread's import of it has finished);
otherwise it puts a finder of its own at the head of ``sys.meta_path``. When the module is imported,
the finder takes the module's own spec from the other finders and puts a stand-in for its loader in
that spec (not on the loader, which a zip or frozen importer shares with other modules: review,
2026-12-07); once the module has run, the stand-in hands the spec its loader back, the finder
removes itself and the callbacks run.

A module that another thread is importing is waited for; where that thread waits in turn for an
import this one holds (one thread imports torch, another torch._dynamo, so the ops' registration
runs inside torch's import), a thread of its own waits and runs the callbacks.

A callback that fails is a warning (dropped where warnings are errors), never a failed import:
the module, its code run, could not be imported again. A spec taken without an import
(``importlib.util.find_spec``) leaves the finder in place for the real one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import warnings
from typing import Callable, List, Tuple


def _warn(failed: str, e: Exception) -> None:
    try:
        warnings.warn(f"nvfp4kv: {failed} ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3)
    except Exception:  # warnings as errors
        pass


def _run(callback: Callable[[], None], failed: str) -> bool:
    """callback(); False and a warning where it raised."""
    try:
        callback()
        return True
    except Exception as e:
        _warn(failed, e)
        return False


class _Loader(importlib.abc.Loader):
    """Stands in for the module's loader in the one spec being imported."""

    def __init__(self, finder: "_AfterImport", spec, loader) -> None:
        self._finder, self._spec, self._loader = finder, spec, loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._spec.loader = module.__loader__ = self._loader  # the module's own loader from here on
        self._loader.exec_module(module)
        self._finder.remove()
        for callback, failed in self._finder.callbacks:
            _run(callback, failed)

    def __getattr__(self, name):  # anything else a loader answers (resources, source)
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: List[Tuple[Callable[[], None], str]] = []
        self._inside = threading.local()  # this thread is in our own lookup (a finder may recurse)

    def find_spec(self, name, path=None, target=None):
        if name != self.name or getattr(self._inside, "busy", False):
            return None
        self._inside.busy = True
        try:
            spec = next((s for f in list(sys.meta_path) if f is not self and hasattr(f, "find_spec")
                         for s in [f.find_spec(name, path, target)] if s is not None), None)
        finally:
            self._inside.busy = False
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):  # else the module as it is, no callbacks
            spec.loader = _Loader(self, spec, loader)
        return spec

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


# The import system's error for a wait that would close a cycle of threads (CPython's, private).
_DEADLOCK = getattr(importlib._bootstrap, "_DeadlockError", RuntimeError)
WAITER = "nvfp4kv-after-import"  # the name of a thread that waits for an import (after_import)


def _wait_and_run(name: str, callback: Callable[[], None], failed: str) -> None:
    if _run(lambda: importlib.import_module(name), failed):
        _run(callback, failed)


def after_import(name: str, callback: Callable[[], None], failed: str) -> None:
    """callback() now where module `name` is imported, else right after its import; if it raises,
    a warning: `failed` and the exception. A module that another thread is still importing (in
    sys.modules, its code not yet run) is waited for: its import has passed the finders (review:
    the substitutions were skipped without a word while a thread imported torch._dynamo). Where
    that thread waits for an import this one holds, a thread named WAITER waits for it, and the
    callback runs there once the module is imported."""
    module = sys.modules.get(name)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            _run(callback, failed)
            return
        try:
            importlib.import_module(name)  # waits on its import lock
        except Exception as e:
            if not isinstance(e, _DEADLOCK):
                _warn(failed, e)
                return
            # The importing thread waits for an import this thread holds (two threads importing
            # torch and torch._dynamo at once: this callback runs inside torch's import). A thread
            # that holds no import lock waits instead (review: the substitutions were lost).
            try:
                threading.Thread(target=_wait_and_run, args=(name, callback, failed), name=WAITER,
                                 daemon=True).start()
            except RuntimeError as started:  # no thread to be had (limits, shutdown): as any failure
                _warn(failed, started)
            return
        _run(callback, failed)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    finder.callbacks.append((callback, failed))
