"""The memlock the NRI plugin asks for is one the runtime can grant (the node tier found one that cannot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_cni.agent.nri.plugin import CAP_SYS_RESOURCE, RLIM_INFINITY, grantable_memlock

FULL = (1 << 41) - 1  # every capability of a 6.x kernel
WITHOUT = FULL & ~(1 << CAP_SYS_RESOURCE)  # what this project's sandboxes give: 000001fffeffffff


def status(tmp_path: Path, bounding: int | None) -> str:
    path = tmp_path / "status"
    lines = ["Name:\tagent\n", "CapEff:\t000001ffffffffff\n"]
    if bounding is not None:
        lines.append(f"CapBnd:\t{bounding:016x}\n")
    path.write_text("".join(lines))
    return str(path)


def test_with_cap_sys_resource_the_configured_limit_stands(tmp_path: Path) -> None:
    assert grantable_memlock(RLIM_INFINITY, status(tmp_path, FULL), hard=8 << 20) == (RLIM_INFINITY, "")


def test_without_it_a_raise_is_dropped_and_said(tmp_path: Path) -> None:
    assert f"{WITHOUT:016x}" == "000001fffeffffff"
    memlock, why = grantable_memlock(RLIM_INFINITY, status(tmp_path, WITHOUT), hard=8 << 20)
    assert memlock is None
    assert "CAP_SYS_RESOURCE" in why and str(8 << 20) in why


@pytest.mark.parametrize("asked", [4 << 20, 8 << 20])
def test_without_it_a_limit_within_the_current_hard_one_stands(tmp_path: Path, asked: int) -> None:
    assert grantable_memlock(asked, status(tmp_path, WITHOUT), hard=8 << 20) == (asked, "")


def test_an_unlimited_hard_limit_needs_no_raise(tmp_path: Path) -> None:
    assert grantable_memlock(RLIM_INFINITY, status(tmp_path, WITHOUT), hard=RLIM_INFINITY) == (
        RLIM_INFINITY,
        "",
    )


def test_off_stays_off_and_an_unreadable_status_changes_nothing(tmp_path: Path) -> None:
    assert grantable_memlock(None, status(tmp_path, WITHOUT), hard=8 << 20) == (None, "")
    assert grantable_memlock(RLIM_INFINITY, str(tmp_path / "missing"), hard=8 << 20) == (RLIM_INFINITY, "")
    assert grantable_memlock(RLIM_INFINITY, status(tmp_path, None), hard=8 << 20) == (RLIM_INFINITY, "")
