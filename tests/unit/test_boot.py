"""Which boot a record belongs to (rdma_cni.node.boot): the boot id exactly, the boot time as a fallback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rdma_cni.node import boot
from rdma_cni.node.boot import CLOCK_SLACK_SECONDS, Boot, judge

THIS = "3b1f0c52-8d0e-4a57-b3c1-9f2e6d7a8b90"
EARLIER = "a0d9e8c7-b6a5-4f43-9210-fedcba987654"
BTIME = 1_780_000_000.0
NOW = BTIME + 3600  # an hour after boot


def this_boot(*, id: str = THIS, time: float | None = BTIME, now: float = NOW) -> Boot:
    return Boot(id, time, now)


def test_another_boot_id_is_an_earlier_boot_whatever_the_clock_says() -> None:
    # Created "after" the boot by the clock (a clock stepped back since): the id decides.
    assert judge(EARLIER, NOW - 1, this_boot()) == ("previous", "exact")
    assert judge(EARLIER, 0.0, this_boot(time=None)) == ("previous", "exact")


def test_this_boot_id_is_this_boot_whatever_the_clock_says() -> None:
    # Created "a day before" the boot (a clock stepped forward since): the id decides.
    assert judge(THIS, BTIME - 86_400, this_boot()) == ("current", "exact")


def test_without_a_boot_id_a_record_well_before_the_boot_is_of_an_earlier_boot() -> None:
    assert judge("", BTIME - CLOCK_SLACK_SECONDS - 1, this_boot()) == ("previous", "fallback")


def test_without_a_boot_id_a_record_after_the_boot_is_of_this_boot() -> None:
    assert judge("", BTIME + 5, this_boot()) == ("current", "fallback")
    assert judge("", BTIME, this_boot()) == ("current", "fallback")


def test_a_record_just_before_the_boot_time_is_kept_a_forward_clock_step_may_explain_it() -> None:
    # NTP stepped the clock forward after the record was written: btime moved past it.
    assert judge("", BTIME - 1, this_boot()) == ("doubt", "fallback")
    assert judge("", BTIME - CLOCK_SLACK_SECONDS, this_boot()) == ("doubt", "fallback")


def test_a_record_from_the_future_is_kept_the_clock_went_back() -> None:
    assert judge("", NOW + 60, this_boot()) == ("doubt", "fallback")


def test_a_record_without_a_creation_time_is_kept() -> None:
    assert judge("", 0.0, this_boot()) == ("doubt", "fallback")
    assert judge("", -5.0, this_boot()) == ("doubt", "fallback")


def test_without_the_boot_time_a_record_without_a_boot_id_is_kept() -> None:
    assert judge("", BTIME - 86_400, this_boot(time=None)) == ("doubt", "fallback")


def test_a_record_with_a_boot_id_while_this_boot_has_none_falls_back_to_the_clock() -> None:
    assert judge(EARLIER, BTIME - 86_400, this_boot(id="")) == ("previous", "fallback")
    assert judge(EARLIER, BTIME + 1, this_boot(id="")) == ("current", "fallback")


def test_the_boot_id_is_read_from_the_kernel_and_checked(tmp_path: Path) -> None:
    assert boot.is_boot_id(boot.boot_id())  # this machine's kernel
    f = tmp_path / "boot_id"
    f.write_text(THIS + "\n")
    assert boot.boot_id(str(f)) == THIS
    f.write_text("not a uuid\n")
    assert boot.boot_id(str(f)) == ""
    f.write_bytes(b"\xff" * 100)
    assert boot.boot_id(str(f)) == ""
    assert boot.boot_id(str(tmp_path / "missing")) == ""


def test_the_boot_time_is_read_from_proc_stat(tmp_path: Path) -> None:
    real = boot.boot_time()
    assert real is not None and 0 < real <= boot.current(real + 1).now
    f = tmp_path / "stat"
    f.write_text("cpu  1 2 3\nintr 5\nbtime 1780000000\nprocesses 9\n")
    assert boot.boot_time(str(f)) == BTIME
    f.write_text("cpu  1 2 3\nbtime soon\n")
    assert boot.boot_time(str(f)) is None
    assert boot.boot_time(str(tmp_path / "missing")) is None


def test_a_state_directory_remembers_the_boot_it_was_checked_in(tmp_path: Path) -> None:
    state = str(tmp_path)
    assert not boot.checked(state, THIS)
    boot.mark_checked(state, this_boot())
    assert boot.checked(state, THIS)
    assert not boot.checked(state, EARLIER)  # the next boot checks again
    marker = os.path.join(state, boot.MARKER)
    assert stat.S_IMODE(os.stat(marker).st_mode) == 0o600
    assert [n for n in os.listdir(state) if n != boot.MARKER] == []  # written atomically, nothing left


def test_without_a_boot_id_nothing_is_remembered_and_nothing_checked_again(tmp_path: Path) -> None:
    assert boot.checked(str(tmp_path), "")
    boot.mark_checked(str(tmp_path), this_boot(id=""))
    assert os.listdir(tmp_path) == []


def test_a_marker_that_cannot_be_written_is_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    boot.mark_checked(str(tmp_path / "missing"), this_boot())
    assert "cannot write boot-checked" in caplog.text
    assert not boot.checked(str(tmp_path / "missing"), THIS)
