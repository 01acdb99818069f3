"""What start-up built, frozen out of the garbage collector's full collections.

A full (generation 2) collection walks every object the collector tracks. In a serving process
those are mostly what start-up made and what lives as long as the process: imported libraries,
the model's modules, the tokenizer. On the development machine one such collection paused the
engine core or an HTTP process for 20-140 ms, several times a run, each a stall of every stream
(docs/PERFORMANCE.md, "Garbage collection pauses"). ``freeze_startup_heap`` moves them to the
permanent generation once start-up is over, as vLLM does: later collections walk only what was
allocated since.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect start-up's garbage, then freeze what is left (call again after later set-up).
    What an earlier call froze is collected too: a process that builds engine after engine (a
    test run, a notebook) frees the dropped ones here rather than never."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Give what was frozen back to the collector: an engine that is shut down no longer needs
    its start-up heap kept out of collections, and objects of it (or of the program around it)
    that have become unreachable in cycles since can be freed."""
    gc.unfreeze()
