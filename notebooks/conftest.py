"""pytest's setting for the chapters that `make test` runs under nbval: their kernels talk over Unix sockets.

nbval starts each chapter's kernel over TCP, jupyter_client's default, which picks free ports and closes
them before the kernel binds them: two kernels starting at once (make test runs one chapter per core)
can pick the same port, and the second chapter then fails before its first cell. The grader's kernels
avoid this the same way (tools/grade.py, `socket_transport`)."""
import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import nbval.kernel
from jupyter_client.manager import KernelManager

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from grade import socket_transport  # noqa: E402

SOCKETS = Path(tempfile.mkdtemp(prefix="nbval-kernels-"))
atexit.register(shutil.rmtree, SOCKETS, ignore_errors=True)


class UnixSocketKernelManager(KernelManager):
    """nbval's KernelManager, its sockets in a folder of their own (one per kernel: no two kernels share names)."""

    def __init__(self, **kwargs):
        super().__init__(config=socket_transport(Path(tempfile.mkdtemp(dir=SOCKETS))), **kwargs)


nbval.kernel.KernelManager = UnixSocketKernelManager
