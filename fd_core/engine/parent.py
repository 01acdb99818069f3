"""A child process of fd's (the engine core, a tensor-parallel rank) ends when its parent does."""

from __future__ import annotations

import os
import threading
import time

CHECK_S = 1.0  # the watchdog thread's period, for a process busy in a long step


def watch_parent(parent_pid: int) -> None:
    """Exit if the parent dies while the main thread is busy (loading a model, a long step):
    re-parenting changes our parent pid. The engine core's idle loop checks too, and exits
    cleanly; tensor-parallel workers rely on this alone."""

    def watch() -> None:
        while True:
            time.sleep(CHECK_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="fd-parent-watch", daemon=True).start()
