"""Entry point for ``python -m rdma_cni`` and the PyInstaller binary."""

import logging
import os
import sys

from rdma_cni.cli import main

if __name__ == "__main__":
    code = main()
    if len(sys.argv) > 1:
        sys.exit(code)
    # A CNI verb is finished once its document is out. Tearing the
    # interpreter down (freeing every module pydantic and pyroute2 brought
    # in) costs a cold start ~25 ms per pod and changes nothing, so flush
    # what was written and leave.
    logging.shutdown()
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            # What the interpreter's own exit reports when stdout cannot be flushed.
            code = 120 if stream is sys.stdout else code
    os._exit(code & 0xFF)
