"""Entry point for ``python -m rdma_cni`` and the PyInstaller binary."""

import gc
import logging
import os
import sys

if len(sys.argv) <= 1:
    # A CNI verb (no subcommand): one short-lived process that `_exit`s once
    # its document is out, so the cycle collector's passes over everything
    # pydantic and pyroute2 allocate at import are wasted (~5 ms of a cold
    # ADD or DEL). Subcommands (the warm server, the agent, the extender)
    # live long and keep it.
    gc.disable()

from rdma_cni.cli.main import main

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
