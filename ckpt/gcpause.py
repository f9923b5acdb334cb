"""The cyclic garbage collector paused around work that makes a large, long-lived object graph."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off for the block, then back on as it was.

    While hundreds of thousands of objects that stay alive are made (a ``transformers`` import, a parsed DCP
    ``.metadata``), the full collections their number triggers rescan all of them and free nothing: about 1 s on an
    export's critical path, ten times the time to unpickle a large ``.metadata``.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
