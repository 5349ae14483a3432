"""Import rules of the package, checked on the source with ast (function-level imports included).

The cluster half (the scheduler extender) must run without the kernel
layer, the node half must not grow a dependency on the cluster half, and the
modules both halves share must stay standard library only. Each rule is a
row in RULES; a module is checked against the imports it can reach inside
the package (transitively), so hiding a kernel import one module away does
not pass either.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "rdma_cni"

# Layers are folders: a rule names a folder and covers every module in it.
KERNEL_LAYER = ("kernel", "node", "verbs")
# The executable's entry points dispatch to every half, by design: the dispatcher and the operator
# subcommands (cli/), the installer (install/). The packed binary's start-up (launch/: the warm
# server above all) is not one of them: it never reaches the agent or the extender.
ENTRY_POINTS = ("__main__", "cli", "install")
SHARED_STDLIB_ONLY = (
    "shared.placement",
    "shared.nodestate",
    "shared.atomicfile",
    "shared.names",
    "shared.quote",
    "shared.errors",
    "shared.quantity",
    # The DRA names and the slices' rendering (the claims' module validates with pydantic, as the
    # pod request does).
    "shared.dra.slices",
)
# Every other layer: shared/ is the bottom of the house, imported by both halves, importing neither.
ABOVE_SHARED = ("cni", "kube", *KERNEL_LAYER, "agent", "extender", *ENTRY_POINTS, "launch", "httpd", "log")
# What `ls rdma_cni` shows (docs/architecture.md's map): every folder a layer, and no loose module
# but these. A new module goes into the folder of its layer; a new folder is a new layer, with its rules.
LAYERS = {
    "shared": "both halves",
    "cni": "both halves",
    "kube": "both halves",
    "kernel": "node half",
    "node": "node half",
    "verbs": "node half",
    "agent": "node half",
    "extender": "cluster half",
    "httpd": "the long-running components' HTTP serving (the agent's and the extender's)",
    "cli": "entry points",
    "install": "entry points",
    "launch": "the packed binary's start-up",
}
LOOSE_MODULES = ("__init__", "__main__", "log")


def module_name(path: str, root: str = ROOT) -> str:
    """``rdma_cni/agent/loop.py`` -> ``rdma_cni.agent.loop`` (a package's ``__init__`` is the package)."""
    rel = os.path.relpath(path, root)[: -len(".py")]
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """Every module of the package: dotted name -> file path."""
    out = {}
    for directory, _dirs, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                out[module_name(path, root)] = path
    return out


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module named by an import anywhere in ``source`` (module level, functions, branches).

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule);
    relative imports are resolved against ``module``.
    """
    found: set[str] = set()
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                origin = ".".join(anchor + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def _within(name: str, modules: Iterable[str]) -> str | None:
    """The package module ``name`` refers to (itself or its closest parent), or None."""
    known = set(modules)
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


@dataclass
class Graph:
    direct: dict[str, set[str]]  # module -> every import it names (package and external)

    @classmethod
    def build(cls, modules: dict[str, str]) -> Graph:
        direct = {}
        for name, path in modules.items():
            with open(path, encoding="utf-8") as f:
                direct[name] = imports_of(f.read(), name, path.endswith("__init__.py"))
        return cls(direct)

    def internal(self, module: str) -> set[str]:
        """Package modules ``module`` imports directly (importing ``a.b`` runs ``a`` too)."""
        out = set()
        for name in self.direct[module]:
            target = _within(name, self.direct)
            while target and target != module:
                out.add(target)
                target = _within(target.rpartition(".")[0], self.direct)
        return out

    def reachable(self, module: str) -> dict[str, list[str]]:
        """Package modules ``module`` can import, each with one import chain leading to it."""
        chains: dict[str, list[str]] = {module: [module]}
        todo = [module]
        while todo:
            current = todo.pop()
            for nxt in sorted(self.internal(current)):
                if nxt not in chains:
                    chains[nxt] = [*chains[current], nxt]
                    todo.append(nxt)
        del chains[module]
        return chains


def _matches(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == f"{PACKAGE}.{p}" or module.startswith(f"{PACKAGE}.{p}.") for p in prefixes)


@dataclass(frozen=True)
class Rule:
    """Modules matching ``applies`` (and not ``exempt``) must not reach modules matching ``forbidden``."""

    name: str
    applies: tuple[str, ...] | None  # None: every module of the package
    forbidden: tuple[str, ...]
    exempt: tuple[str, ...] = ()
    allowed: tuple[str, ...] = ()  # never forbidden, even when ``forbidden`` matches everything


RULES = [
    Rule("the extender never imports the kernel layer", ("extender",), (*KERNEL_LAYER, "agent")),
    Rule(
        "node-side modules never import the agent or the extender",
        None,
        ("agent", "extender"),
        exempt=(*ENTRY_POINTS, "agent", "extender"),
    ),
    Rule("the agent never imports the extender", ("agent",), ("extender",)),
    # nodestate hands placement its view of a node; both stay standard library only.
    Rule(
        "shared modules import only each other",
        SHARED_STDLIB_ONLY,
        ("",),
        allowed=("shared",),
    ),
    # Both halves use the Kubernetes clients: they must not pull either half in.
    Rule("the Kubernetes clients import no other layer", ("kube",), (*KERNEL_LAYER, "agent", "extender")),
    # A cold ADD loads the pod GET: never the long-running client (nor requests behind it).
    Rule(
        "the plugin's pod GET never loads the long-running client",
        ("kube.podget",),
        ("kube.client", "kube.pool", "kube.events"),
    ),
    # The verbs decide on decoded documents; reading HTTP and admitting callers is the server's.
    Rule(
        "the extender's verbs know nothing of HTTP",
        ("extender.verbs",),
        ("extender.server", "extender.listener", "extender.main", "extender.service", "extender.options"),
    ),
    # The arrows point down: shared/ (the pod request above all) takes nothing from cni/ or higher.
    Rule("shared modules never import a layer above them", ("shared",), ABOVE_SHARED),
    # The entry point hands the warm server what its children run (cli/main's main): no circle.
    Rule("the packed binary's start-up never imports the entry points", ("launch",), ENTRY_POINTS),
]


def violations(rule: Rule, graph: Graph) -> list[str]:
    """One line per (module, forbidden module reached), with the import chain."""
    out = []
    for module in sorted(graph.direct):
        applies = _matches(module, rule.applies) if rule.applies is not None else True
        if not applies or _matches(module, rule.exempt):
            continue
        for target, chain in sorted(graph.reachable(module).items()):
            if target == PACKAGE or _matches(target, rule.allowed):
                continue  # the package's __init__ (version string) is imported by everything
            if rule.forbidden == ("",) or _matches(target, rule.forbidden):
                out.append(f"{module} reaches {target} via {' -> '.join(chain)}")
    return out


def non_stdlib(graph: Graph, module: str) -> set[str]:
    """Top-level packages ``module`` names that are not the standard library."""
    # Package imports are the rules' business; this is about everything else.
    allowed = set(sys.stdlib_module_names) | {"__future__", PACKAGE}
    return {n.split(".")[0] for n in graph.direct[module] if n.split(".")[0] not in allowed}


# ---------------------------------------------------------------------------
# The package as it is


@pytest.fixture(scope="module")
def graph() -> Graph:
    return Graph.build(package_modules())


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_rule_holds(rule: Rule, graph: Graph) -> None:
    if rule.applies is not None:
        # A rule about modules that do not exist would pass for nothing.
        assert any(_matches(m, rule.applies) for m in graph.direct), f"no module matches {rule.applies}"
    assert violations(rule, graph) == []


@pytest.mark.parametrize("name", SHARED_STDLIB_ONLY)
def test_shared_modules_are_stdlib_only(name: str, graph: Graph) -> None:
    module = f"{PACKAGE}.{name}"
    assert module in graph.direct, f"{module} is missing"
    # A package (shared.placement) is checked module by module.
    for member in sorted(m for m in graph.direct if _matches(m, (name,))):
        assert non_stdlib(graph, member) == set(), member


def test_every_kernel_layer_module_exists(graph: Graph) -> None:
    # A renamed kernel module would silently fall out of the extender rule.
    for name in KERNEL_LAYER:
        assert _matches_any(name, graph), f"{PACKAGE}.{name} is gone: update KERNEL_LAYER"


def test_the_top_of_the_package_is_its_layers() -> None:
    top = os.path.join(ROOT, PACKAGE)
    folders = {n for n in os.listdir(top) if os.path.isfile(os.path.join(top, n, "__init__.py"))}
    loose = {n.removesuffix(".py") for n in os.listdir(top) if n.endswith(".py")}
    assert sorted(folders) == sorted(LAYERS), "a new folder is a new layer: add it to LAYERS and its rules"
    assert sorted(loose) == sorted(LOOSE_MODULES), "a new module goes into the folder of its layer"


def _matches_any(name: str, graph: Graph) -> bool:
    return any(_matches(m, (name,)) for m in graph.direct)


# The agent's NRI messages are protobuf code generated at build time (agent/nri/*.proto), and so
# are kubelet's DRA messages (agent/dra/*_pb2.py, from k8s.io/kubelet's .proto files): protobuf is a
# runtime dependency that only those packages may import, so that no other path (a CNI verb's cold
# start above all, which tests/unit/test_cli_binary.py watches in the binary) can load it.
PROTOBUF_USERS = ("agent.nri", "agent.dra")
# grpcio serves kubelet's DRA plugin calls, and nothing else: only the module that serves them.
GRPC_USERS = ("agent.dra.kubelet",)


def protobuf_importers(graph: Graph) -> list[str]:
    """Modules outside PROTOBUF_USERS that import google.* themselves."""
    return sorted(
        m
        for m, names in graph.direct.items()
        if any(n.split(".")[0] == "google" for n in names) and not _matches(m, PROTOBUF_USERS)
    )


def test_only_the_nri_plugin_imports_protobuf(graph: Graph) -> None:
    assert protobuf_importers(graph) == []
    # It does use it: the messages are generated, not coded by hand.
    assert "google.protobuf.message" in graph.direct[f"{PACKAGE}.agent.nri.plugin"]


def grpc_reachers(graph: Graph) -> list[str]:
    """Modules that import grpc themselves or reach a GRPC_USERS module, but are not one (or the
    entry points and agent modules that start the plugin lazily, inside a function)."""
    out = []
    for module, names in sorted(graph.direct.items()):
        if _matches(module, GRPC_USERS):
            continue
        if any(n.split(".")[0] == "grpc" for n in names):
            out.append(module)
    return out


def test_only_the_kubelet_plugin_imports_grpc(graph: Graph) -> None:
    assert grpc_reachers(graph) == []
    assert "grpc" in graph.direct[f"{PACKAGE}.agent.dra.kubelet"]
    # No CNI verb, and no shared or cluster-side module, can reach the plugin (and grpcio behind it).
    for module in sorted(graph.direct):
        if _matches(module, ("verbs", "node", "kernel", "shared", "extender", "cni", "kube")):
            assert f"{PACKAGE}.agent.dra.kubelet" not in graph.reachable(module), module


def test_protobuf_outside_the_nri_plugin_is_caught(tmp_path: object) -> None:
    graph = _fake_package(
        tmp_path,
        {
            **BASE,
            "agent/nri/__init__.py": "",
            "agent/nri/plugin.py": "from google.protobuf.message import DecodeError\n",
            "cni/config.py": "def f():\n    from google.protobuf import message\n",
        },
    )
    assert protobuf_importers(graph) == [f"{PACKAGE}.cni.config"]


# ---------------------------------------------------------------------------
# The checker itself, on a made-up package: each rule must catch what it forbids


def _fake_package(tmp_path: object, files: dict[str, str]) -> Graph:
    root = str(tmp_path)
    for rel, text in files.items():
        path = os.path.join(root, PACKAGE, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return Graph.build(package_modules(root))


BASE = {
    "__init__.py": "",
    "kernel/__init__.py": "",
    "kernel/sysfs.py": "import os\n",
    "shared/__init__.py": "",
    "shared/placement.py": "from __future__ import annotations\nimport math\n",
    "shared/nodestate.py": "import json\nfrom rdma_cni.shared import placement\n",
    "cni/__init__.py": "",
    "cni/errors.py": "",
    "cni/config.py": "import json\n",
    "agent/__init__.py": "",
    "agent/loop.py": "from rdma_cni.kernel import sysfs\n",
    "extender/__init__.py": "",
    "extender/decide.py": "from rdma_cni.shared import placement, nodestate\n",
    "extender/verbs.py": "from rdma_cni.extender import decide\n",
    "extender/server.py": "from rdma_cni.extender import verbs\n",
    "kube/__init__.py": "",
    "kube/credentials.py": "from rdma_cni.cni import errors\n",
    "kube/podget.py": "from rdma_cni.kube import credentials\n",
    "kube/client.py": "from rdma_cni.kube import credentials\n",
}


def test_clean_fake_package_passes(tmp_path: object) -> None:
    graph = _fake_package(tmp_path, BASE)
    assert all(violations(rule, graph) == [] for rule in RULES)
    assert non_stdlib(graph, "rdma_cni.shared.placement") == set()


@pytest.mark.parametrize(
    ("changed", "rule_index", "expected"),
    [
        # a kernel import hidden inside a function of the extender
        (
            {"extender/decide.py": "def f():\n    from rdma_cni.kernel.sysfs import net_devices\n"},
            0,
            "rdma_cni.extender.decide reaches rdma_cni.kernel.sysfs",
        ),
        # ... or one module away, through a relative import
        (
            {
                "extender/decide.py": "from ..cni import config\n",
                "cni/config.py": "from rdma_cni.kernel import sysfs\n",
            },
            0,
            "rdma_cni.extender.decide reaches rdma_cni.kernel.sysfs via rdma_cni.extender.decide -> "
            "rdma_cni.cni.config -> rdma_cni.kernel.sysfs",
        ),
        # a node-side module importing the agent lazily
        (
            {"cni/config.py": "def f():\n    import rdma_cni.agent.loop\n"},
            1,
            "rdma_cni.cni.config reaches rdma_cni.agent",
        ),
        ({"agent/loop.py": "if True:\n    from rdma_cni.extender import decide\n"}, 2, "rdma_cni.agent.loop"),
        (
            {"shared/nodestate.py": "from rdma_cni.cni import config\n"},
            3,
            "rdma_cni.shared.nodestate reaches rdma_cni.cni",
        ),
        # allowed: nodestate -> placement; but not what placement would then reach
        (
            {
                "shared/nodestate.py": "from rdma_cni.shared import placement\n",
                "shared/placement.py": "from rdma_cni.cni import errors\n",
            },
            3,
            "rdma_cni.shared.nodestate reaches rdma_cni.cni",
        ),
        # a credentials helper that would read the node's state
        (
            {"kube/credentials.py": "def f():\n    from rdma_cni.kernel import sysfs\n"},
            4,
            "rdma_cni.kube.credentials reaches rdma_cni.kernel.sysfs",
        ),
        # the pod GET borrowing from the long-running client, even one module away
        (
            {"kube/credentials.py": "from rdma_cni.kube import client\n"},
            5,
            "rdma_cni.kube.podget reaches rdma_cni.kube.client via rdma_cni.kube.podget -> "
            "rdma_cni.kube.credentials -> rdma_cni.kube.client",
        ),
        # a verb reaching back into the HTTP server
        (
            {"extender/decide.py": "def f():\n    from rdma_cni.extender.server import MAX_BODY\n"},
            6,
            "rdma_cni.extender.verbs reaches rdma_cni.extender.server via rdma_cni.extender.verbs -> "
            "rdma_cni.extender.decide -> rdma_cni.extender.server",
        ),
        # the pod request taking its error type from the CNI edge, as it once did
        (
            {"shared/podrequest.py": "from rdma_cni.cni.errors import InvalidPodRequest\n"},
            7,
            "rdma_cni.shared.podrequest reaches rdma_cni.cni.errors",
        ),
        # the warm server importing the entry point its children run, as it once did
        (
            {
                "cli/__init__.py": "",
                "cli/main.py": "def main():\n    from rdma_cni.launch import warm\n",
                "launch/__init__.py": "",
                "launch/warm.py": "def child():\n    from rdma_cni.cli.main import main\n",
            },
            8,
            "rdma_cni.launch.warm reaches rdma_cni.cli.main",
        ),
    ],
)
def test_each_rule_catches_its_violation(
    tmp_path: object, changed: dict[str, str], rule_index: int, expected: str
) -> None:
    graph = _fake_package(tmp_path, {**BASE, **changed})
    found = violations(RULES[rule_index], graph)
    assert any(line.startswith(expected) for line in found), found


def test_third_party_import_in_shared_module_is_caught(tmp_path: object) -> None:
    graph = _fake_package(tmp_path, {**BASE, "shared/placement.py": "def f():\n    import pydantic\n"})
    assert non_stdlib(graph, "rdma_cni.shared.placement") == {"pydantic"}
