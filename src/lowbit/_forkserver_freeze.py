"""Imported last by :func:`lowbit.launch.start_method`'s forkserver preload: build numba's typing and
target contexts, then collect and freeze every object the server has made (torch, torch._dynamo's ~900
modules, lowbit, numba).

numba builds its contexts on a process's first kernel call (loading a cached kernel included): ~0.6 s of
CPU on the 2-core machine, which every child paid again at its first codec call (3 codecs' first use:
0.65 s cold, 0.07 s with the contexts built). Building them runs no kernel, so no thread pool (numba's
OpenMP layer must not be live in a process that forks) starts in the server. Skipped without numba.

A child forked from the server shares those objects' pages copy-on-write. Without the freeze every
``gc.collect()`` in a child (lowbit.launch.shutdown runs one, and Python's own collections run often)
walks them all and writes to their headers, copying the pages: 0.3 s a rank with 2 ranks on a 2-core
machine, 0.9 s with 4, paid at least twice per spawn. Frozen objects sit in a permanent generation that
the collector skips (``gc.freeze``), so a child's collections see only what it made itself. The server
unfreezes them when it exits, so that its own teardown frees them as usual (frozen, triton's bindings
report them as leaked)."""

import atexit
import gc

try:
    from numba.core.registry import cpu_target
except ImportError:  # numba is optional (the reference kernels run without it)
    pass
else:
    cpu_target.typing_context.refresh()
    cpu_target.target_context.refresh()

gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)
