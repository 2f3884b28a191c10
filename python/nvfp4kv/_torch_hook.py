"""Registers the torch custom ops (:mod:`nvfp4kv.ops`) when torch is imported after nvfp4kv.

``import nvfp4kv`` imports no torch. Where torch is already loaded it imports ``nvfp4kv.ops``
at once; otherwise it calls :func:`install`, which puts a finder at the head of
``sys.meta_path``. When ``import torch`` runs, the finder takes torch's own spec from the other
finders and puts a stand-in for its loader in that spec: once torch's ``__init__`` has run,
``nvfp4kv.ops`` is imported, and the finder removes itself. So a program that
imports nvfp4kv first still traces the Python API as the ops under ``torch.compile`` (before, its
calls broke the graph, and ``fullgraph=True`` failed in Dynamo; design notes: "torch.compile:
the API traced as custom ops").

A registration that fails is a warning (dropped where warnings are errors), never a failed
``import torch``; ``import nvfp4kv.ops`` then tries again. A spec taken without an import
(``importlib.util.find_spec("torch")``) leaves the finder in place for the real one.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings


def _register() -> None:
    try:
        from . import ops  # noqa: F401  (registers torch.ops.nvfp4kv.*)
    except Exception as e:  # torch is imported either way; only the ops are missing
        try:
            warnings.warn(f"nvfp4kv: the torch custom ops were not registered when torch was imported "
                          f"({type(e).__name__}: {e}); torch.compile will not trace nvfp4kv's calls until "
                          "`import nvfp4kv.ops` succeeds", RuntimeWarning, stacklevel=2)
        except Exception:  # warnings as errors: torch, whose __init__ has run, cannot be imported twice
            pass


class _Loader(importlib.abc.Loader):
    """Stands in for torch's loader in the one spec being imported; nothing is set on the loader
    itself, which may serve other modules too (a zip or frozen importer: review, 2026-12-07)."""

    def __init__(self, finder: "_OpsAfterTorch", spec, loader) -> None:
        self._finder, self._spec, self._loader = finder, spec, loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._spec.loader = module.__loader__ = self._loader  # torch's own loader from here on
        self._loader.exec_module(module)
        self._finder.remove()
        _register()

    def __getattr__(self, name):  # anything else a loader answers (resources, source)
        return getattr(self._loader, name)


class _OpsAfterTorch(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._inside = threading.local()  # this thread is in our own lookup (a finder may recurse)

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or getattr(self._inside, "busy", False):
            return None
        self._inside.busy = True
        try:
            spec = next((s for f in list(sys.meta_path) if f is not self and hasattr(f, "find_spec")
                         for s in [f.find_spec(name, path, target)] if s is not None), None)
        finally:
            self._inside.busy = False
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):  # else torch as it is, without the ops
            spec.loader = _Loader(self, spec, loader)
        return spec

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Register the ops when torch is imported, unless a finder of ours already waits for it."""
    if not any(isinstance(f, _OpsAfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _OpsAfterTorch())
