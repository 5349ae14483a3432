"""PF-side VF settings: the neutral values defined once, and VfInfo's two directions agreeing."""

from __future__ import annotations

from typing import Any

import pytest

from rdma_cni.kernel.netlink import VfInfo, neutral_vf_settings


def test_neutral_settings_are_a_fresh_dict_each_time() -> None:
    # ADD stores these lists in records: one caller's change must not become everyone's default.
    first = neutral_vf_settings()
    first["vlan"][0] = 100
    first["trust"] = True
    assert neutral_vf_settings() == {
        "rate": [0, 0],
        "vlan": [0, 0],
        "spoofchk": True,
        "trust": False,
        "link_state": "auto",
        "mac": "00:00:00:00:00:00",
    }


@pytest.mark.parametrize(
    "settings",
    [
        neutral_vf_settings(),
        {"rate": [1000, 2000], "vlan": [12, 3], "spoofchk": False, "trust": True},
        {"mac": "02:00:00:00:00:01", "link_state": "disable"},
        {},
    ],
)
def test_from_settings_is_the_inverse_of_settings(settings: dict[str, Any]) -> None:
    assert VfInfo.from_settings(7, settings).settings() == settings
    assert VfInfo.from_settings(7, settings).vf == 7


def test_every_neutral_setting_is_one_vfinfo_reports() -> None:
    # A setting with a neutral value but no VfInfo field would never be read back (nor restored).
    assert set(VfInfo.from_settings(0, neutral_vf_settings()).settings()) == set(neutral_vf_settings())
