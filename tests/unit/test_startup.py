"""rdma_cni.launch.startup: a deferred module runs only when used, and behaves as itself once it is.

Each case runs in a fresh interpreter: deferring changes sys.modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, path: Path | None = None, **env: str) -> Any:
    """Run ``code`` in a fresh interpreter (``path`` first on sys.path); what it prints, as JSON."""
    environ = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    pythonpath = [str(ROOT)] + ([str(path)] if path else [])
    environ["PYTHONPATH"] = os.pathsep.join(pythonpath)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def package(tmp_path: Path) -> Path:
    """A package whose import is visible: each module appends its name to a file when it runs."""
    root = tmp_path / "site"
    pkg = root / "deferme"
    pkg.mkdir(parents=True)
    log = tmp_path / "ran.log"
    record = f"open({str(log)!r}, 'a').write(__name__ + '\\n')\n"
    (pkg / "__init__.py").write_text(record + "def hello(who):\n    return 'hello ' + who\nVALUE = 42\n")
    (pkg / "sub.py").write_text(record + "NAME = 'sub'\n")
    return root


def ran(tmp_path: Path) -> list[str]:
    log = tmp_path / "ran.log"
    return log.read_text().split() if log.exists() else []


def test_deferred_module_runs_on_first_use_only(tmp_path: Path) -> None:
    out = run(
        """
        import json, sys
        from rdma_cni.launch.startup import defer_import
        defer_import("deferme", ("hello",))
        import deferme
        from deferme import hello
        stand_in = sys.modules["deferme"]
        probed = hasattr(deferme, "__wrapped__")
        value = deferme.VALUE
        print(json.dumps({"probed": probed, "value": value, "greeting": hello("pod"),
                          "replaced": sys.modules["deferme"] is not stand_in}))
        """,
        package(tmp_path),
    )
    assert out == {"probed": False, "value": 42, "greeting": "hello pod", "replaced": True}
    assert ran(tmp_path) == ["deferme"]  # once, at the attribute read


def test_deferred_module_not_used_never_runs(tmp_path: Path) -> None:
    out = run(
        """
        import json, sys
        from rdma_cni.launch.startup import defer_import
        defer_import("deferme", ("hello",))
        import deferme
        from deferme import hello
        file = getattr(deferme, "__file__", None)
        print(json.dumps({"has_path": hasattr(deferme, "__path__"), "file": file}))
        """,
        package(tmp_path),
    )
    # A package keeps its __path__ (submodules stay importable); other dunders do not load it.
    assert out == {"has_path": True, "file": None}
    assert ran(tmp_path) == []


def test_forwarded_function_loads_the_module_when_called(tmp_path: Path) -> None:
    out = run(
        """
        import json
        from rdma_cni.launch.startup import defer_import
        defer_import("deferme", ("hello",))
        from deferme import hello
        print(json.dumps(hello("node")))
        """,
        package(tmp_path),
    )
    assert out == "hello node"
    assert ran(tmp_path) == ["deferme"]


def test_submodule_of_a_deferred_package_and_its_parent_attribute(tmp_path: Path) -> None:
    out = run(
        """
        import json, sys
        from rdma_cni.launch.startup import defer_import
        defer_import("deferme.sub")
        import deferme.sub
        stand_in = deferme.sub
        name = deferme.sub.NAME
        print(json.dumps({"name": name, "parent_attr_is_real": deferme.sub is sys.modules["deferme.sub"],
                          "was_stand_in": stand_in is not sys.modules["deferme.sub"]}))
        """,
        package(tmp_path),
    )
    assert out == {"name": "sub", "parent_attr_is_real": True, "was_stand_in": True}
    assert ran(tmp_path) == ["deferme", "deferme.sub"]


def test_already_imported_or_missing_modules_are_left_alone() -> None:
    out = run(
        """
        import json, sys, json.decoder
        from rdma_cni.launch.startup import defer_import
        before = sys.modules["json.decoder"]
        defer_import("json.decoder")
        defer_import("no_such_module_rdma_cni")
        print(json.dumps({"same": sys.modules["json.decoder"] is before,
                          "missing": "no_such_module_rdma_cni" in sys.modules}))
        """
    )
    assert out == {"same": True, "missing": False}


def test_quiet_pydantic_validates_a_config_without_importlib_metadata() -> None:
    out = run(
        """
        import json, sys
        from rdma_cni.launch.startup import quiet_pydantic
        quiet_pydantic()
        from rdma_cni.cni.config import load_netconf
        conf = load_netconf({"cniVersion": "1.0.0", "name": "net", "ipam": {"type": "host-local"}})
        untouched = [m for m in ("email", "zipfile", "csv") if m in sys.modules]
        from importlib.metadata import version
        print(json.dumps({"name": conf.name, "untouched": untouched, "pydantic": version("pydantic"),
                          "disabled": __import__("os").environ["PYDANTIC_DISABLE_PLUGINS"]}))
        """
    )
    import pydantic

    assert out == {"name": "net", "untouched": [], "pydantic": pydantic.VERSION, "disabled": "__all__"}


def test_plugins_enabled_after_all_still_scan_through_the_real_module() -> None:
    """A deployment that sets PYDANTIC_DISABLE_PLUGINS itself keeps pydantic's plugin scan working."""
    out = run(
        """
        import json, sys
        from rdma_cni.launch.startup import quiet_pydantic
        quiet_pydantic()
        from rdma_cni.cni.config import load_netconf
        load_netconf({"cniVersion": "1.0.0", "name": "net"})
        print(json.dumps({"loaded": "email" in sys.modules,
                          "real": sys.modules["importlib.metadata"].entry_points.__module__}))
        """,
        PYDANTIC_DISABLE_PLUGINS="some-plugin-that-is-not-installed",
    )
    assert out == {"loaded": True, "real": "importlib.metadata"}


def test_defer_unused_keeps_what_the_verbs_never_use_out() -> None:
    """pydantic and pyroute2 load, a record is logged, and secrets, hashlib and multiprocessing stay out."""
    out = run(
        """
        import json, logging, sys
        from rdma_cni.launch.startup import defer_unused
        defer_unused()
        from rdma_cni import log
        from rdma_cni.cni.config import load_netconf
        from rdma_cni.kernel.nlsock import pyroute2_module
        load_netconf({"cniVersion": "1.0.0", "name": "net"})
        ifinfmsg = pyroute2_module("pyroute2.netlink.rtnl.ifinfmsg")
        logging.getLogger("rdma_cni.test").warning("a record")
        # (secrets and multiprocessing are in sys.modules as stand-ins; these come only with the real ones)
        out = sorted(m for m in ("hmac", "hashlib", "multiprocessing.context") if m in sys.modules)
        # Once used, each is itself.
        import multiprocessing, secrets
        from pyroute2 import config
        print(json.dumps({"out": out, "token": len(secrets.token_hex(4)),
                          "process": multiprocessing.current_process().name,
                          "pipe": config.MpPipe.__name__}))
        """
    )
    assert out == {"out": [], "token": 8, "process": "MainProcess", "pipe": "Pipe"}
