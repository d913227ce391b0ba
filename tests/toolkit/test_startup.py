"""toolkit.startup: imports run without the garbage collector, and what they made is frozen."""
import gc
import importlib
import sys

from toolkit.startup import imports_uncollected


def test_no_collection_inside_and_the_made_objects_frozen_after():
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    frozen = gc.get_freeze_count()
    try:
        with imports_uncollected():
            assert not gc.isenabled()
            sys.modules.pop("fractions", None)
            importlib.import_module("fractions")  # some import: thousands of objects
            made = [[i] for i in range(100_000)]  # > gc's thresholds: a collection would have run
        assert collections == [] and gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.callbacks.pop()
        gc.unfreeze()


def test_a_disabled_collector_stays_disabled_and_nothing_is_frozen():
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        with imports_uncollected():
            made = [[i] for i in range(1000)]
        assert not gc.isenabled() and gc.get_freeze_count() == frozen and made
    finally:
        gc.enable()
