"""The garbage collector's frozen heap: what a one-engine process freezes at start-up, and a bench's frozen stretch
that hands everything back after, so that an engine dropped later is still freed."""

import gc
import weakref

from pagedllm.utils import freeze_gc_heap, gc_heap_frozen


class _Cyclic:
    def __init__(self) -> None:
        self.me = self  # only the cyclic collector frees it


def test_frozen_stretch_hands_objects_back():
    obj = _Cyclic()
    alive = weakref.ref(obj)
    with gc_heap_frozen():
        assert gc.get_freeze_count() > 0
        del obj
        gc.collect()
        assert alive() is not None  # frozen: the collector does not look at it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # handed back: freed


def test_freeze_collects_garbage_first():
    obj = _Cyclic()
    alive = weakref.ref(obj)
    del obj
    try:
        assert freeze_gc_heap() > 0
        assert alive() is None  # collected before the freeze, not kept forever
    finally:
        gc.unfreeze()
