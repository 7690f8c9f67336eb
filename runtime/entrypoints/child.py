"""The entry point of every child process (schedulers, detokenizer).

    python -m radixlm.runtime.entrypoints.child FD PARENT_PID

`launch.py` starts this module with `subprocess.Popen` (never multiprocessing), so a child never
imports the user's `__main__`: an Engine built at module level of a plain script works. FD is this
child's end of a socketpair (a `multiprocessing.connection.Connection`):

    parent -> child   (module, function, args)       once, right after the start
    child  -> parent  SchedulerReady / DetokenizerReady / ChildFailed     the readiness handshake

The child then runs `module.function(*args, conn)`. It asks Linux to SIGKILL it when its parent
dies, and exits at once if the parent is already gone. Ctrl-C is ignored: the parent gets it and
shuts the children down in order.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from multiprocessing.connection import Connection

from ..utils import kill_self_with_parent


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[1]), int(argv[2])
    kill_self_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        module, func, args = conn.recv()
    except EOFError:            # the parent went away before sending the job
        sys.exit(1)
    try:   # tqdm's default lock is a multiprocessing semaphore, leaked when a child is terminated
        import tqdm

        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    getattr(importlib.import_module(module), func)(*args, conn)


if __name__ == "__main__":
    main(sys.argv)
