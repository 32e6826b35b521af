"""Imported last by :func:`lowbit.launch.start_method`'s forkserver preload: collect, then freeze, every
object the server has made (torch, torch._dynamo's ~900 modules, lowbit, numba).

A child forked from the server shares those objects' pages copy-on-write. Without the freeze every
``gc.collect()`` in a child (lowbit.launch.shutdown runs one, and Python's own collections run often)
walks them all and writes to their headers, copying the pages: 0.3 s a rank with 2 ranks on a 2-core
machine, 0.9 s with 4, paid at least twice per spawn. Frozen objects sit in a permanent generation that
the collector skips (``gc.freeze``), so a child's collections see only what it made itself. The server
unfreezes them when it exits, so that its own teardown frees them as usual (frozen, triton's bindings
report them as leaked)."""

import atexit
import gc

gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)
