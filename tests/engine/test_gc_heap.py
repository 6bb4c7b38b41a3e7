"""jaxkv/engine/gc_heap.py: the heap frozen and the young threshold raised while an engine runs,
and both put back for a user's process."""

import gc

import pytest

from jaxkv.engine import gc_heap


@pytest.fixture(autouse=True)
def plain_collector():
    """Each test starts from CPython's defaults, and the process's state is put back after
    (an in-process server of another test may have frozen the heap and raised the threshold)."""
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*thresholds)
    if frozen:
        gc.freeze()


def test_frozen_heap_raises_the_young_threshold_inside_and_restores_it():
    before = gc.get_threshold()
    with gc_heap.frozen_heap():
        assert gc.get_threshold() == (gc_heap.YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_freeze_startup_heap_keeps_a_higher_threshold_and_a_frozen_heap_is_left_alone():
    before = gc.get_threshold()
    try:
        gc.set_threshold(10 * gc_heap.YOUNG_THRESHOLD, *before[1:])
        assert gc_heap.freeze_startup_heap() > 0
        assert gc.get_threshold()[0] == 10 * gc_heap.YOUNG_THRESHOLD
        gc.set_threshold(*before)
        with gc_heap.frozen_heap():  # someone froze it already: nothing changes
            assert gc.get_threshold() == before
    finally:
        gc_heap.release_frozen_heap()
        gc.set_threshold(*before)
    assert gc.get_freeze_count() == 0
