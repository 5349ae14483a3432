"""Start-up economies for a cold start: modules a verb imports but never uses.

Standard library only and cheap to import, so the verbs can call it before
the first pydantic import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any


def defer_import(name: str, functions: tuple[str, ...] = ()) -> None:
    """Make ``import name`` cheap: the real module is imported when first used, not before.

    For a module that a dependency imports at its top but uses only on a path
    the plugin does not take. Until then ``sys.modules[name]`` is a stand-in:
    any attribute read from it imports the real module (which then replaces
    it) and answers from that; each of ``functions`` is there already, as a
    function that does the same when called, for code that binds it early
    (``from name import function``). A module already imported is left as it is.
    """
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    stand_in = types.ModuleType(name, f"stands in for {name} until it is used (rdma_cni.launch.startup)")
    if spec.submodule_search_locations is not None:
        # A package: its submodules can still be imported through the stand-in.
        stand_in.__path__ = list(spec.submodule_search_locations)

    def real() -> types.ModuleType:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
        return importlib.import_module(name)

    def forward(function: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(real(), function)(*args, **kwargs)

        call.__name__ = call.__qualname__ = function
        return call

    def module_getattr(attr: str) -> Any:  # PEP 562: only for attributes the stand-in lacks
        if attr.startswith("__"):
            # The import system and introspection probe these (`from m import f`
            # asks for __path__ first): answering them must not import m.
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        return getattr(real(), attr)

    stand_in.__getattr__ = module_getattr  # type: ignore[method-assign]
    for function in functions:
        setattr(stand_in, function, forward(function))
    sys.modules[name] = stand_in
    parent, _, child = name.rpartition(".")
    if parent:
        # What the import system does for a submodule it loads: `import a.b` then reads a.b.
        setattr(importlib.import_module(parent), child, stand_in)


def quiet_pydantic() -> None:
    """Call before pydantic is imported: no scan for its plugins, and none of what the scan needs.

    Without it pydantic reads the metadata of every installed distribution at
    its first model (~20 ms). ``importlib.metadata``, which pydantic imports
    at its top only for that scan, costs another ~13-20 ms of imports (email,
    zipfile, pathlib, csv) per cold start: it is deferred, and loads on first
    use if plugins are enabled after all (``PYDANTIC_DISABLE_PLUGINS`` set otherwise).
    """
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    defer_import("importlib.metadata", ("entry_points",))


# Modules the verbs' dependencies import at their top for features the plugin
# never uses, with the functions those dependencies bind from them at import.
UNUSED_AT_START: dict[str, tuple[str, ...]] = {
    # pydantic.types: only SecretStr/SecretBytes comparisons (compare_digest);
    # with it go hmac, hashlib and OpenSSL's libcrypto set-up.
    "secrets": (),
    # pyroute2.config binds Pipe, Queue and Process for its process-based
    # namespace helpers; the plugin enters namespaces itself (rdma_cni.kernel.netns).
    "multiprocessing": ("Pipe", "Queue", "Process"),
}


def defer_unused() -> None:
    """Call before the verbs' dependencies are imported: defer what they import and the plugin never uses.

    :func:`quiet_pydantic` as well, and :data:`UNUSED_AT_START` (~5 ms of a cold
    ADD or DEL). Each still works, loaded on first use, if some path needs it.
    """
    quiet_pydantic()
    for name, functions in UNUSED_AT_START.items():
        defer_import(name, functions)
