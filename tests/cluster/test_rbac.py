"""RBAC is what docs/deploy.md says: ``kubectl auth can-i --list`` per service account matches its table.

What every service account may do (discovery, self-reviews) is subtracted, as
measured on an account with no binding, and so is what the built-in roles the
table names grant (measured on an account bound to exactly those), so the
table lists exactly what conf/ adds. The other cluster tests prove each
component works with those rights.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster.conftest import unique
from tests.support.kube.controlplane import REPO, ControlPlane

DEPLOY = Path(REPO) / "docs" / "deploy.md"
HEADING = "### What the API server grants"
Right = tuple[str, str, str]  # resource (or non-resource URL), resource names, verb


def doc_table() -> dict[str, tuple[list[str], set[Right]]]:
    """The table under HEADING: account -> (built-in roles it also holds, rights)."""
    text = DEPLOY.read_text()
    section = text[text.index(HEADING) :].split("\n\n", 2)[2]
    rows: dict[str, tuple[list[str], set[Right]]] = {}
    for line in section.splitlines()[2:]:  # after the header and its rule
        if not line.startswith("| `"):
            break
        account, builtins, rights = (cell.strip() for cell in line.strip("|").split("|"))
        parsed: set[Right] = set()
        for item in filter(None, (i.strip() for i in rights.split(";"))):
            m = re.fullmatch(r"((?:`[a-z]+`(?:, )?)+) (\S+)(?: \((`[^)]*`)\))?", item)
            assert m, f"docs/deploy.md: cannot read {item!r}"
            names = ",".join(sorted(re.findall(r"`([^`]+)`", m.group(3) or "")))
            parsed |= {(m.group(2), names, verb) for verb in re.findall(r"`([a-z]+)`", m.group(1))}
        rows[account.strip("`")] = (re.findall(r"`([^`]+)`", builtins), parsed)
    return rows


def can_i_list(cp: ControlPlane, account: str, namespace: str) -> set[Right]:
    """Every (resource or URL, names, verb) ``kubectl auth can-i --list`` shows for a service account."""
    out = cp.kubectl(
        "auth", "can-i", "--list", f"--as=system:serviceaccount:{account}", "-n", namespace
    ).stdout.splitlines()
    header = out[0]
    starts = [header.index(col) for col in ("Resources", "Non-Resource URLs", "Resource Names", "Verbs")]
    rights: set[Right] = set()
    for line in out[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        resource, urls, names, verbs = cells
        targets = [resource] if resource else urls.strip("[]").split()
        for target in targets:
            for verb in verbs.strip("[]").split():
                rights.add((target, ",".join(sorted(names.strip("[]").split())), verb))
    return rights


@pytest.fixture(scope="module")
def baseline(applied: ControlPlane) -> set[Right]:
    return can_i_list(applied, f"kube-system:{unique('nobody')}", "kube-system")


def builtin_rights(cp: ControlPlane, roles: list[str]) -> set[Right]:
    """What an account bound to exactly these built-in roles may do (kube-system)."""
    account = unique("reference")
    cp.kubectl("create", "serviceaccount", account, "-n", "kube-system")
    for role in roles:
        binding = unique("reference")
        if cp.kubectl("get", "clusterrole", role, check=False).returncode == 0:
            cp.kubectl("create", "clusterrolebinding", binding, f"--clusterrole={role}",
                       f"--serviceaccount=kube-system:{account}")  # fmt: skip
        else:
            cp.kubectl("create", "rolebinding", binding, "-n", "kube-system", f"--role={role}",
                       f"--serviceaccount=kube-system:{account}")  # fmt: skip
    return can_i_list(cp, f"kube-system:{account}", "kube-system")


def test_the_table_names_every_service_account_conf_creates(applied: ControlPlane) -> None:
    accounts = {
        f"{sa['metadata']['namespace']}/{sa['metadata']['name']}"
        for sa in applied.get("serviceaccounts", "-A")["items"]
        if sa["metadata"]["name"].startswith("rdma")
    }
    assert accounts == set(doc_table()), "docs/deploy.md's table and conf/'s service accounts differ"


@pytest.mark.parametrize("account", sorted(doc_table()))
def test_can_i_list_matches_the_table(applied: ControlPlane, baseline: set[Right], account: str) -> None:
    builtins, documented = doc_table()[account]
    granted = can_i_list(applied, account.replace("/", ":"), "kube-system") - baseline
    if builtins:
        granted -= builtin_rights(applied, builtins)
    assert granted == documented, (
        f"{account}: granted but not in docs/deploy.md: {sorted(granted - documented)}; "
        f"documented but not granted: {sorted(documented - granted)}"
    )


def test_a_right_added_to_a_role_is_caught(applied: ControlPlane, baseline: set[Right]) -> None:
    # The comparison is not vacuous: one more verb on the agent's account shows up.
    account = unique("widened")
    applied.kubectl("create", "serviceaccount", account, "-n", "kube-system")
    # The agent's account holds conf/base/node/rbac.yaml's role and conf/dra.yaml's (the DRA driver's rights).
    for granted in ("rdma-cni", "rdma-cni-dra"):
        applied.kubectl("create", "clusterrolebinding", f"{account}-{granted}", f"--clusterrole={granted}",
                        f"--serviceaccount=kube-system:{account}")  # fmt: skip
    _, documented = doc_table()["kube-system/rdma-cni"]
    assert can_i_list(applied, f"kube-system:{account}", "kube-system") - baseline == documented
    role = unique("extra")
    applied.kubectl("create", "clusterrole", role, "--verb=list", "--resource=secrets")
    applied.kubectl("create", "clusterrolebinding", role, f"--clusterrole={role}",
                    f"--serviceaccount=kube-system:{account}")  # fmt: skip
    assert can_i_list(applied, f"kube-system:{account}", "kube-system") - baseline - documented == {
        ("secrets", "", "list")
    }
