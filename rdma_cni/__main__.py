"""Entry point for ``python -m rdma_cni`` and the PyInstaller binary."""

import sys

from rdma_cni.cli import main

if __name__ == "__main__":
    sys.exit(main())
