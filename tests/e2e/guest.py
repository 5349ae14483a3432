"""Boot a throw-away QEMU guest with a real (emulated) SR-IOV NIC and run one scenario.

The guest is Debian trixie's kernel and userland from the cache built by
``prepare.sh``, running under QEMU TCG with an Intel 82576 (``-device igb``) whose
VFs are real PCI virtual functions. It has no disk: its root is the cached tree
shared over 9p (writable through a tmpfs overlay that dies with the guest), and a
per-boot *share* directory on the host is mounted at ``/mnt/share`` in the guest.

Share layout (host path ``GuestRun.share``, guest path ``/mnt/share``)::

    scenario.sh      the scenario, run with bash as root            (written by boot)
    guest_setup.sh   helpers for scenarios (source it)              (written by boot)
    bin/cnirun       the libcni runtime; bin/ is on the guest PATH  (written by boot)
    in/              extra files passed to boot(files=...)          (written by boot)
    out/             results the scenario leaves for the host       (guest, $E2E_OUT)
    scenario.log     the scenario's stdout and stderr               (guest)
    console.log      serial console: kernel messages + scenario     (QEMU)
    qemu.log         QEMU's own stdout and stderr                   (host)
    guest-times      guest uptime when the scenario started/ended   (guest)
    exit-code        the scenario's exit status, written last       (guest)

A scenario gets ``E2E_SHARE``, ``E2E_IN`` and ``E2E_OUT`` once it sources
``guest_setup.sh``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: Guest-side path of the share; the initramfs mounts it there.
GUEST_SHARE = "/mnt/share"

#: Files boot() owns in the share; removed before each boot so nothing stale is read.
_RUN_FILES = ("scenario.log", "console.log", "qemu.log", "guest-times", "exit-code")

#: An extra file for the share: a host path (file or directory) or literal contents.
#: Plain str is refused on purpose: it would be ambiguous between path and contents.
FileSource = Path | bytes

# SeaBIOS clears the screen with terminal escapes; they only garble failure reports.
_ESCAPES = re.compile(r"\x1b(?:\[[0-9;?]*[A-Za-z]|[A-Za-z])")


class GuestError(AssertionError):
    """A guest run did not end with exit status 0; the message carries its logs."""


@dataclass
class GuestRun:
    """What one boot left behind.

    Attributes:
        share: host path of the share directory (see the module docstring).
        exit_code: the scenario's exit status, or None if the guest never reported
            one (timeout, kernel panic, QEMU failure).
        timed_out: QEMU was killed because the timeout expired.
        wall_seconds: host wall time from starting QEMU until it exited.
        guest_times: guest uptime (seconds) at ``scenario_start`` and ``scenario_end``.
        qemu_returncode: QEMU's exit status (negative for a signal).
    """

    share: Path
    exit_code: int | None
    timed_out: bool
    wall_seconds: float
    qemu_returncode: int | None
    guest_times: dict[str, float] = field(default_factory=dict)

    @property
    def out(self) -> Path:
        """Host path of the scenario's result directory (``$E2E_OUT`` in the guest)."""
        return self.share / "out"

    @property
    def ok(self) -> bool:
        """True when the scenario ran to completion and exited 0."""
        return self.exit_code == 0

    @property
    def console(self) -> str:
        """The serial console log: kernel messages interleaved with scenario output."""
        return _read_text(self.share / "console.log")

    @property
    def scenario_log(self) -> str:
        """The scenario's own stdout and stderr, without kernel messages."""
        return _read_text(self.share / "scenario.log")

    @property
    def qemu_log(self) -> str:
        """QEMU's stdout and stderr (errors starting the VM end up here)."""
        return _read_text(self.share / "qemu.log")

    def read_text(self, name: str) -> str:
        """Read a result file, relative to ``out/``."""
        return (self.out / name).read_text()

    def read_json(self, name: str) -> Any:
        """Read and decode a JSON result file, relative to ``out/``."""
        return json.loads(self.read_text(name))

    def describe(self) -> str:
        """A human-readable account of the run, with the logs, for failure reports."""
        if self.timed_out:
            status = f"timed out after {self.wall_seconds:.0f} s"
        elif self.exit_code is None:
            status = f"no exit code from the guest (QEMU exit status {self.qemu_returncode})"
        else:
            status = f"scenario exit status {self.exit_code}"
        parts = [f"guest run in {self.share}: {status}"]
        qemu = self.qemu_log.strip()
        if qemu:
            parts.append(f"--- qemu.log ---\n{qemu}")
        parts.append(f"--- console.log ---\n{_ESCAPES.sub('', self.console)}")
        return "\n".join(parts)

    def check(self) -> GuestRun:
        """Raise GuestError (with the console log) unless the scenario exited 0."""
        if not self.ok:
            raise GuestError(self.describe())
        return self


#: What the ``e2e_boot`` fixtures hand to tests: ``(scenario, files=None, timeout=600.0)``
#: bound to the session's cache and the test's share.
BootFn = Callable[..., GuestRun]


def _read_text(path: Path) -> str:
    try:
        # Console output can carry terminal escapes and stray bytes from the firmware.
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _install(dest: Path, source: FileSource) -> None:
    """Put one extra file (or directory tree) into the share."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(source, bytes):
        dest.write_bytes(source)
    elif not isinstance(source, Path):
        raise TypeError(f"extra file {dest.name!r}: want a Path or bytes, got {type(source).__name__}")
    elif source.is_dir():
        shutil.copytree(source, dest, dirs_exist_ok=True)
    else:
        # copy2 keeps the mode: executables (dist/rdma-cni) must stay executable.
        shutil.copy2(source, dest)


def prepare_share(
    cache_dir: Path, share_dir: Path, scenario_script: str, files: Mapping[str, FileSource] | None = None
) -> None:
    """Lay out the share for one boot (see the module docstring for the layout).

    Args:
        cache_dir: the cache built by prepare.sh (provides cnirun).
        share_dir: the share directory; created if missing.
        scenario_script: bash source of the scenario.
        files: extra files for ``in/``: name (may contain ``/``) -> a host Path (file
            or directory, copied with its mode) or bytes (written with mode 0644).
    """
    share_dir.mkdir(parents=True, exist_ok=True)
    for name in _RUN_FILES:
        (share_dir / name).unlink(missing_ok=True)
    for name in ("out", "in"):
        shutil.rmtree(share_dir / name, ignore_errors=True)
    (share_dir / "out").mkdir()
    (share_dir / "in").mkdir()
    (share_dir / "bin").mkdir(exist_ok=True)
    (share_dir / "scenario.sh").write_text(scenario_script)
    shutil.copy2(HERE / "guest_setup.sh", share_dir / "guest_setup.sh")
    shutil.copy2(cache_dir / "cnirun", share_dir / "bin" / "cnirun")
    for name, source in (files or {}).items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"extra file name must stay inside in/: {name!r}")
        _install(share_dir / "in" / rel, source)


def qemu_command(cache_dir: Path, share_dir: Path, *, memory_mb: int = 1536, smp: int = 2) -> list[str]:
    """The host command line that runs trixie's QEMU on the cached tree.

    Paths after the first four arguments are as seen inside the chroot (see
    qemu-chroot.sh): the share is /mnt/share and the initramfs /mnt/boot/initrd.img.
    """
    kernel_version = (cache_dir / "kernel-version").read_text().strip()
    return [
        str(HERE / "qemu-chroot.sh"),
        str(cache_dir / "root"),
        str(share_dir),
        str(cache_dir / "initrd.img"),
        # /dev/kvm exists on the CI machine but a KVM guest makes no progress there.
        "-accel", "tcg",
        "-M", "q35",
        "-m", str(memory_mb),
        "-smp", str(smp),
        "-nographic",
        "-monitor", "none",
        "-serial", f"file:{GUEST_SHARE}/console.log",
        "-no-reboot",
        "-kernel", f"/boot/vmlinuz-{kernel_version}",
        "-initrd", "/mnt/boot/initrd.img",
        "-append", "console=ttyS0 panic=-1 quiet",
        # multidevs=remap: the exported tree spans several host filesystems (the
        # chroot's /mnt and /proc); remapping keeps inode numbers unique in the guest.
        "-virtfs", "local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap",
        "-virtfs", f"local,path={GUEST_SHARE},mount_tag=share,security_model=none",
        # The igb PF needs a backend; restrict=on keeps the guest off the host network.
        "-netdev", "user,id=n0,restrict=on",
        # Behind a root port the PF is 0000:01:00.0 and its VFs get bus 1 to themselves.
        "-device", "pcie-root-port,id=rp0,chassis=1",
        "-device", "igb,bus=rp0,netdev=n0",
    ]  # fmt: skip


def _read_guest_times(path: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    for line in _read_text(path).splitlines():
        key, sep, value = line.partition("=")
        if sep:
            with contextlib.suppress(ValueError):
                times[key.strip()] = float(value)
    return times


def boot(
    cache_dir: Path | str,
    share_dir: Path | str,
    scenario_script: str,
    *,
    files: Mapping[str, FileSource] | None = None,
    timeout: float = 600.0,
    memory_mb: int = 1536,
    smp: int = 2,
) -> GuestRun:
    """Boot the guest, run ``scenario_script`` in it as root, and wait for power-off.

    The scenario runs under bash in the guest with ``/mnt/share`` as ``E2E_SHARE``;
    it should ``source "$E2E_SHARE/guest_setup.sh"`` first. Results written to
    ``$E2E_OUT`` are readable afterwards through ``GuestRun.out`` / ``read_json``.
    The share is reset (logs, ``in/``, ``out/``) at the start of every boot.

    Args:
        cache_dir: directory prepared by ``prepare.sh``.
        share_dir: host directory to share with the guest.
        scenario_script: bash source of the scenario.
        files: extra files placed under ``in/`` before boot (see prepare_share).
        timeout: seconds before QEMU is killed; the run then has ``timed_out``.
        memory_mb: guest RAM.
        smp: guest CPUs (TCG threads: mind the host's cores).

    Returns:
        The GuestRun; call ``.check()`` to turn a failure into an exception that
        carries the console log.
    """
    cache = Path(cache_dir).resolve()
    share = Path(share_dir).resolve()
    prepare_share(cache, share, scenario_script, files)
    command = qemu_command(cache, share, memory_mb=memory_mb, smp=smp)

    timed_out = False
    start = time.monotonic()
    with (share / "qemu.log").open("wb") as qemu_log:
        # A session of its own so that a timeout can kill QEMU and anything it spawned.
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=qemu_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
        except BaseException:
            # Ctrl-C or a pytest timeout must not leave a guest burning CPU.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.monotonic() - start

    exit_code: int | None = None
    code_text = _read_text(share / "exit-code").strip()
    if code_text:
        with contextlib.suppress(ValueError):
            exit_code = int(code_text)
    return GuestRun(
        share=share,
        exit_code=exit_code,
        timed_out=timed_out,
        wall_seconds=wall,
        qemu_returncode=returncode,
        guest_times=_read_guest_times(share / "guest-times"),
    )
