"""The node state's PF-name rule is the kernel's own: each name is tried on the real kernel.

``shared/names.kernel_ifname`` restates the kernel's ``dev_valid_name`` (the
node state refuses a PF name the kernel could never have reported). A veth
pair is created under each name in a fresh network namespace; the kernel's
yes or no must be the rule's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rdma_cni.shared.names import kernel_ifname

NAMES = [
    "a",
    "ens1f0",
    "x" * 15,
    "x" * 16,
    "é" * 7,  # 14 bytes
    "é" * 8,  # 16 bytes
    "à",  # C3 A0: 0xa0 is whitespace in the kernel's ctype
    "\u00a0",
    "a b",
    "a\tb",
    "a\nb",
    "\x1b[2J",  # control characters are not whitespace to the kernel
    "\x1b]0;t\x07",
    "\u2028",
    "a\u0085b",
    "\u202eeth0",
    ".",
    "..",
    "...",
    "a/b",
    "a:b",
    "eth%d",  # a template: the kernel picks a name, but takes this one
    "-",
    "ib0.8001",
]

# Run in a fresh network namespace (unshare -n), so that nothing is left on the host.
_PROBE = textwrap.dedent(
    """
    import json, sys
    from pyroute2 import IPRoute
    names = json.loads(sys.stdin.read())
    out = []
    with IPRoute() as ipr:
        for i, name in enumerate(names):
            try:
                ipr.link("add", ifname=name, kind="veth", peer=f"peer{i}")
            except Exception:
                out.append(False)
                continue
            out.append(True)
            for index in ipr.link_lookup(ifname=f"peer{i}"):
                ipr.link("del", index=index)
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating links needs root")
def test_the_pf_name_rule_is_the_kernels() -> None:
    proc = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", _PROBE],
        input=json.dumps(NAMES),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    kernel = json.loads(proc.stdout)
    differ = [
        (name, said, kernel_ifname(name))
        for name, said in zip(NAMES, kernel, strict=True)
        if said != kernel_ifname(name)
    ]
    assert not differ, f"(name, kernel, rule): {differ}"
