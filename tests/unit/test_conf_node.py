"""conf/node/: the boot unit that sets a PF's sriov_numvfs, parsed, verified by systemd, and its command run.

And docs/deploy.md's node preparation and OpenShift steps: the unit's install steps, the RHCOS
MachineConfig (the same unit, byte for byte), and the DaemonSet patch for Multus' directories there.

The command runs here against a file standing in for ``/sys/class/net/<pf>/device/sriov_numvfs``,
with the expansions systemd makes (``%I``, ``${NUMVFS}``, ``$$``); ``systemd-analyze verify``
checks the unit as systemd reads it (skipped, saying so, where it is missing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CONF = Path(__file__).resolve().parents[2] / "conf"
UNIT = CONF / "node" / "rdma-cni-sriov-numvfs@.service"
DEPLOY = CONF.parent / "docs" / "deploy.md"


def sections(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as systemd reads it: section -> (key, value) in order (keys may repeat)."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line.strip()):
            current = out.setdefault(m.group(1), [])
            continue
        assert current is not None, f"{line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, line
        current.append((key.strip(), value.strip()))
    return out


def value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit[section] if k == key]


def test_the_unit_runs_once_before_the_runtime_and_kubelet() -> None:
    unit = sections(UNIT)
    assert set(unit) == {"Unit", "Service", "Install"}
    assert value(unit, "Service", "Type") == ["oneshot"]
    assert value(unit, "Service", "RemainAfterExit") == ["yes"]
    before = " ".join(value(unit, "Unit", "Before")).split()
    assert {"kubelet.service", "containerd.service", "crio.service"} <= set(before)
    # It waits for the PF's netdev (the device unit udev makes for it), by the instance name.
    assert value(unit, "Unit", "After") == ["sys-subsystem-net-devices-%i.device"]
    assert value(unit, "Unit", "Requires") == ["sys-subsystem-net-devices-%i.device"]
    assert value(unit, "Install", "WantedBy") == ["multi-user.target"]
    # The count: 8 unless the PF's env file says otherwise (optional: "-").
    assert value(unit, "Service", "Environment") == ["NUMVFS=8"]
    assert value(unit, "Service", "EnvironmentFile") == ["-/etc/rdma-cni/sriov-numvfs/%I.env"]


def expand(command: str, pf: str, numvfs: str, sysfs_file: Path) -> list[str]:
    """``ExecStart`` as systemd runs it for instance ``pf``, with the sysfs file moved to ``sysfs_file``."""
    command = command.replace("%I", pf).replace("%i", pf).replace("${NUMVFS}", numvfs).replace("$$", "$")
    command = command.replace(f"/sys/class/net/{pf}/device/sriov_numvfs", str(sysfs_file))
    shell, flags, script = re.fullmatch(r"(\S+) (-\w+) '(.*)'", command).groups()  # type: ignore[union-attr]
    return [shell, flags, script]


@pytest.mark.parametrize(("before", "numvfs"), [("0", "8"), ("4", "8"), ("8", "16")])
def test_the_command_sets_the_count(tmp_path: Path, before: str, numvfs: str) -> None:
    (command,) = value(sections(UNIT), "Service", "ExecStart")
    sysfs_file = tmp_path / "sriov_numvfs"
    sysfs_file.write_text(before + "\n")
    subprocess.run(expand(command, "ens1f0", numvfs, sysfs_file), check=True)
    assert sysfs_file.read_text() == numvfs + "\n"


def test_a_count_in_place_is_left_alone(tmp_path: Path) -> None:
    (command,) = value(sections(UNIT), "Service", "ExecStart")
    sysfs_file = tmp_path / "sriov_numvfs"
    sysfs_file.write_text("8\n")
    os.utime(sysfs_file, (0, 0))
    subprocess.run(expand(command, "ens1f0", "8", sysfs_file), check=True)
    assert sysfs_file.stat().st_mtime == 0  # never written: the VFs in use stay


def test_a_missing_pf_fails_the_unit(tmp_path: Path) -> None:
    (command,) = value(sections(UNIT), "Service", "ExecStart")
    run = subprocess.run(expand(command, "ens1f0", "8", tmp_path / "gone" / "sriov_numvfs"), check=False)
    assert run.returncode != 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    shutil.copy(UNIT, tmp_path / UNIT.name)
    instance = tmp_path / "rdma-cni-sriov-numvfs@ens1f0.service"
    instance.symlink_to(UNIT.name)
    run = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(instance)],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0 and "rdma-cni-sriov-numvfs" not in run.stderr, run.stderr


def test_the_docs_install_it_as_the_unit_says() -> None:
    """deploy.md's steps name the file, the env file and the instance as the unit's header does."""
    text = DEPLOY.read_text()
    header = [line[1:].strip() for line in UNIT.read_text().splitlines() if line.startswith("#   ")]
    for step in header:
        assert (
            step.replace("rdma-cni-sriov-numvfs@.service /", "conf/node/rdma-cni-sriov-numvfs@.service /")
            in text
        ), step


def deploy_blocks(lang: str, needle: str) -> list[str]:
    from tests.support.docblocks import blocks

    return [b.text for b in blocks(DEPLOY) if b.lang == lang and needle in b.text]


def test_the_machineconfig_carries_the_unit_and_its_files() -> None:
    import urllib.parse

    import yaml

    (text,) = deploy_blocks("yaml", "kind: MachineConfig")
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "machineconfiguration.openshift.io/v1"
    assert doc["spec"]["kernelArguments"] == ["ib_core.netns_mode=0"]
    config = doc["spec"]["config"]
    assert config["ignition"]["version"].startswith("3.")
    units = {u["name"]: u for u in config["systemd"]["units"]}
    assert units[UNIT.name]["contents"] == UNIT.read_text()
    instances = [n for n in units if n.startswith("rdma-cni-sriov-numvfs@") and n != UNIT.name]
    assert instances and all(units[n]["enabled"] is True for n in instances)
    files = {f["path"]: f for f in config["storage"]["files"]}
    for name in instances:
        pf = name.split("@", 1)[1].removesuffix(".service")
        env = files[f"/etc/rdma-cni/sriov-numvfs/{pf}.env"]
        assert env["mode"] == 0o644
        source = env["contents"]["source"]
        assert source.startswith("data:,")
        assert re.fullmatch(r"NUMVFS=\d+\n", urllib.parse.unquote(source[len("data:,") :]))
    nri = files["/etc/crio/crio.conf.d/99-rdma-cni-nri.conf"]
    assert (
        urllib.parse.unquote(nri["contents"]["source"][len("data:,") :]) == "[crio.nri]\nenable_nri = true\n"
    )


def apply_json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902's ``add`` and ``replace`` on a copy of ``doc``, as the API server applies them."""
    import copy

    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = op["path"].lstrip("/").split("/")
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            if op["op"] == "add" and last == "-":
                target.append(op["value"])
            else:
                assert op["op"] == "replace" and 0 <= int(last) < len(target), op
                target[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in target, op
            target[last] = op["value"]
    return doc


def test_the_openshift_patch_moves_the_shim_to_multus_bin_dir() -> None:
    """docs/deploy.md's patch on conf/base/node/daemonset.yaml: shim lands in the host's /var/lib/cni/bin."""
    import json

    import yaml

    from rdma_cni.install.command import _parser

    (text,) = deploy_blocks("sh", "patch daemonset rdma-cni")
    ops = json.loads(re.search(r"-p '(.*)'", text, re.S).group(1))  # type: ignore[union-attr]
    with open(CONF / "base/node/daemonset.yaml", encoding="utf-8") as f:
        daemonset = yaml.safe_load(f)
    patched = apply_json_patch(daemonset, ops)
    spec = patched["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = _parser().parse_args(container["command"][2:])
    assert args.cni_bin_dir == "/var/lib/cni/bin"
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    # The directory the installer writes to is the host's /var/lib/cni/bin, at the same path.
    assert volumes[mounts[args.cni_bin_dir]]["hostPath"]["path"] == "/var/lib/cni/bin"
    assert "/opt/cni/bin" not in mounts
    # Nothing else changed.
    original = daemonset["spec"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == [v["name"] for v in original["volumes"]]
    assert container["command"][:-1] == original["containers"][0]["command"]
