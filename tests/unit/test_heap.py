"""``tierflow.heap``: a serving process keeps its startup heap out of garbage collections."""

import gc
import weakref

from tierflow.heap import freeze_startup_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_startup_heap_is_out_of_collections_and_later_garbage_is_not():
    startup = _Cycle()
    frozen_ref = weakref.ref(startup)
    try:
        assert freeze_startup_heap() == gc.get_freeze_count() > 0
        del startup
        gc.collect()
        assert frozen_ref() is not None  # frozen: no collection walks it
        later = weakref.ref(_Cycle())  # garbage made after the freeze is still collected
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen_ref() is None
