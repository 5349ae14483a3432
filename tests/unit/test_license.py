"""The licence setup.cfg declares is the one the repository ships, in full."""

from __future__ import annotations

import configparser
import hashlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# sha256 of the Apache License 2.0 as Debian ships it (/usr/share/common-licenses/Apache-2.0),
# which is the text apache.org publishes.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_one_setup_cfg_declares() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["metadata"]["license"] == "Apache-2.0"
    assert cfg["metadata"]["license_files"].split() == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        text = f.read()
    assert text.lstrip().startswith(b"Apache License\n                           Version 2.0, January 2004")
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256
