"""The release of an earlier boot's records where it can go wrong: the CNI server's start, the
subcommand it runs, the verb that finds the release failing, and what IPAM DEL is given."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rdma_cni.agent import bootrelease, cniserver
from rdma_cni.agent.cniserver import CniServer
from rdma_cni.cli.main import run_cni
from rdma_cni.cni.config import DEFAULT_LOCK_FILE, DEFAULT_STATE_DIR
from rdma_cni.cni.errors import TryAgainLater
from rdma_cni.node import boot
from rdma_cni.node.record import Attachment, PodInfo, RecordStore
from rdma_cni.verbs import gc

REPO = Path(__file__).resolve().parents[2]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def logged() -> Iterator[Collect]:
    """What the rdma_cni loggers say (the entry point's handler may stop propagation to caplog)."""
    handler = Collect()
    logger = logging.getLogger("rdma_cni")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def script(path: Path, body: str) -> str:
    """A plugin stand-in for the server's release at start; as the workers' zygote it only fails to start."""
    path.write_text(f'#!/bin/sh\n[ "$1" = cni-workers ] && exit 1\n{body}\n')
    path.chmod(0o755)
    return str(path)


def start_and_close(tmp_path: Path, plugin: list[str], **kwargs: Any) -> None:
    server = CniServer(str(tmp_path / "agent" / "cni.sock"), plugin, environ={}, **kwargs)
    server.start()
    server.close()


def test_the_server_runs_the_subcommand_for_its_state_directory(tmp_path: Path, logged: Collect) -> None:
    argv = tmp_path / "argv"
    plugin = script(tmp_path / "plugin", f'echo "$@" > {argv}; echo \'{{"checked": true}}\'')
    start_and_close(tmp_path, [plugin], states=[("/s/state", "/s/lock")])
    assert argv.read_text().split() == [
        "release-previous-boot",
        "--state-dir=/s/state",
        "--lock-file=/s/lock",
    ]
    assert 'records of earlier boots in /s/state: {"checked": true}' in logged.text


def test_without_a_state_directory_the_server_runs_nothing(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    start_and_close(tmp_path, [script(tmp_path / "plugin", f"touch {ran}")])
    assert not ran.exists()


def test_a_release_that_fails_is_logged_and_the_server_serves(tmp_path: Path, logged: Collect) -> None:
    plugin = script(tmp_path / "plugin", 'echo \'{"failed": ["c/net1"]}\'; echo "kernel said no" >&2; exit 1')
    start_and_close(tmp_path, [plugin], states=[(str(tmp_path / "state"), str(tmp_path / "lock"))])
    assert 'exit 1: {"failed": ["c/net1"]} kernel said no' in logged.text


def test_a_plugin_that_cannot_run_is_logged_and_the_server_serves(tmp_path: Path, logged: Collect) -> None:
    start_and_close(
        tmp_path, [str(tmp_path / "missing")], states=[(str(tmp_path / "s"), str(tmp_path / "l"))]
    )
    assert f"records of earlier boots in {tmp_path / 's'} not released" in logged.text


def test_a_release_that_hangs_is_cut_off_and_the_server_serves(tmp_path: Path, logged: Collect) -> None:
    plugin = script(tmp_path / "plugin", "sleep 30")
    states = [(str(tmp_path / "s"), str(tmp_path / "l"))]
    start_and_close(tmp_path, [plugin], states=states, verb_timeout=0.5)
    assert "not released" in logged.text and "timed out" in logged.text


def network(path: Path, **entry: Any) -> str:
    """A conflist of one rdma-cni network; ``entry`` its plugin entry's settings."""
    path.write_text(
        json.dumps({"cniVersion": "1.1.0", "name": "n", "plugins": [{"type": "rdma-cni", **entry}]})
    )
    return str(path)


def test_each_networks_state_directory_once_and_a_refused_one_skipped(
    tmp_path: Path, logged: Collect
) -> None:
    a = network(tmp_path / "a.conflist", stateDir="/a/state", lockFile="/a/lock")
    same = network(tmp_path / "same.conflist", stateDir="/a/./state/", lockFile="/a/lock")
    b = network(tmp_path / "b.conflist", stateDir="/b/state", lockFile="/b/lock")
    relative = network(tmp_path / "relative.conflist", stateDir="b/state")
    missing = str(tmp_path / "missing.conflist")
    assert bootrelease.network_states([a, relative, same, missing, b]) == [
        ("/a/state", "/a/lock"),
        ("/b/state", "/b/lock"),
    ]
    assert f"records of earlier boots of {relative} not released at start" in logged.text
    assert "must be an absolute path, got 'b/state'" in logged.text
    assert f"cannot read network config {missing}" in logged.text


def test_without_networks_the_plugins_defaults() -> None:
    assert bootrelease.network_states([]) == [(DEFAULT_STATE_DIR, DEFAULT_LOCK_FILE)]


def test_the_server_runs_the_subcommand_for_each_state_directory(tmp_path: Path) -> None:
    argv = tmp_path / "argv"
    plugin = script(tmp_path / "plugin", f'echo "$@" >> {argv}; echo \'{{"checked": true}}\'')
    start_and_close(tmp_path, [plugin], states=[("/a/state", "/a/lock"), ("/b/state", "/b/lock")])
    assert argv.read_text().splitlines() == [
        "release-previous-boot --state-dir=/a/state --lock-file=/a/lock",
        "release-previous-boot --state-dir=/b/state --lock-file=/b/lock",
    ]


def test_the_networks_share_one_time_budget(tmp_path: Path, logged: Collect) -> None:
    """The server serves only after: a release that hangs leaves the next network to its own first verb."""
    plugin = script(tmp_path / "plugin", "sleep 30")
    states = [(str(tmp_path / "a"), str(tmp_path / "la")), (str(tmp_path / "b"), str(tmp_path / "lb"))]
    started = time.monotonic()
    start_and_close(tmp_path, [plugin], states=states, verb_timeout=0.5)
    assert time.monotonic() - started < 10
    assert f"records of earlier boots in {tmp_path / 'a'} not released" in logged.text
    assert f"records of earlier boots in {tmp_path / 'b'} not released: no time left at start" in logged.text


@pytest.mark.parametrize(
    ("argv", "states"),
    [
        ([], [(DEFAULT_STATE_DIR, DEFAULT_LOCK_FILE)]),
        (["--state-dir=/s"], [("/s", DEFAULT_LOCK_FILE)]),
        (["--network-config=NET"], [("/n/state", "/n/lock")]),
        (
            ["--network-config=NET", "--state-dir=/s", "--lock-file=/l"],
            [("/n/state", "/n/lock"), ("/s", "/l")],
        ),
        (["--network-config=NET", "--state-dir=/n/state", "--lock-file=/n/lock"], [("/n/state", "/n/lock")]),
    ],
)
def test_cni_server_releases_its_networks_and_its_state_dir(
    tmp_path: Path, argv: list[str], states: list[tuple[str, str]]
) -> None:
    net = network(tmp_path / "n.conflist", stateDir="/n/state", lockFile="/n/lock")
    args = cniserver.parser().parse_args([a.replace("NET", net) for a in argv])
    assert cniserver._states(args) == states


@pytest.mark.parametrize("option", ["--state-dir", "--lock-file"])
def test_cni_server_refuses_a_relative_path(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cniserver.main([option, "relative/path"]) == 2
    assert f"{option} must be an absolute path" in capsys.readouterr().err


def run_subcommand(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rdma_cni", "release-previous-boot", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_subcommand_refuses_a_state_directory_others_can_write(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    proc = run_subcommand("--state-dir", str(state), "--lock-file", str(tmp_path / "lock"))
    assert proc.returncode == 1
    answer = json.loads(proc.stdout)
    assert answer["code"] == 5 and str(state) in answer["error"]


def test_the_subcommand_on_a_state_directory_with_nothing_recorded(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    proc = run_subcommand("--state-dir", str(state), "--lock-file", str(tmp_path / "lock"))
    assert (proc.returncode, json.loads(proc.stdout)) == (0, {"checked": True}), proc.stderr
    assert os.listdir(state) == []  # nothing made: the verb that makes the records' directory notes the boot


def test_the_records_directory_made_in_this_boot_notes_it(tmp_path: Path) -> None:
    """A directory made now holds nothing of an earlier boot: no later pass under the lock."""
    state = tmp_path / "state"
    RecordStore(str(state)).ensure()
    assert boot.checked(str(state), boot.boot_id())


def test_a_records_directory_already_there_is_not_noted(tmp_path: Path) -> None:
    """One that exists may hold an earlier boot's records (a node rebooted, or upgraded to this version)."""
    state = tmp_path / "state"
    (state / "attachments").mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    RecordStore(str(state)).ensure()
    assert not boot.checked(str(state), boot.boot_id())


def test_a_verb_is_served_when_the_release_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logged: Collect
) -> None:
    def busy(*_args: object, **_kwargs: object) -> None:
        raise TryAgainLater("node lock /x is held by another rdma-cni for more than 1 s; try again later")

    monkeypatch.setattr(gc, "release_previous_boot", busy)
    conf = {
        "cniVersion": "1.1.0",
        "name": "n",
        "type": "rdma-cni",
        "stateDir": str(tmp_path / "state"),
        "lockFile": str(tmp_path / "lock"),
        "pfs": ["nosuchpf0"],
    }
    code, doc = run_cni({"CNI_COMMAND": "STATUS"}, json.dumps(conf).encode())
    assert "records of earlier boots not released: node lock /x is held" in logged.text
    # The verb ran its own course: STATUS found no PF (code 50), not the release's error (11).
    assert code == 1 and doc is not None and doc["code"] == 50


def attachment(pod: PodInfo | None) -> Attachment:
    return Attachment("c1", "net1", "n", "/run/netns/x", "1.1.0", pod=pod, cni_path=["/opt/cni/bin", "/b"])


def test_ipam_del_of_an_earlier_boot_gets_its_attachment_and_pod() -> None:
    env = gc._ipam_env(attachment(PodInfo("team-a", "trainer-0", "u1")), {"PATH": "/bin", "CNI_IFNAME": "x"})
    assert env.path == ("/opt/cni/bin", "/b") and env.container_id == "c1"
    assert env.environ == {
        "PATH": "/bin",
        "CNI_COMMAND": "DEL",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "",
        "CNI_IFNAME": "net1",
        "CNI_PATH": "/opt/cni/bin:/b",
        "CNI_ARGS": "IgnoreUnknown=true;K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=trainer-0;K8S_POD_UID=u1",
    }


@pytest.mark.parametrize("pod", [PodInfo("a;K8S_POD_NAME=b", "p"), PodInfo("a", "p=q"), None])
def test_a_pod_that_cannot_be_said_in_cni_args_is_left_out(pod: PodInfo | None) -> None:
    assert gc._ipam_env(attachment(pod), {}).environ["CNI_ARGS"] == "IgnoreUnknown=true"


def test_why_a_record_is_kept_is_said() -> None:
    now = boot.Boot("", 1000.0, 2000.0)
    old = Attachment("c", "i", "n", "", "1.1.0", created_at=100.0)
    assert "not home in the host" in gc._why_kept(old, now)
    unknown = Attachment("c", "i", "n", "", "1.1.0")
    assert gc._why_kept(unknown, now) == "created at 0, boot at 1000.0, no boot id in the record"
