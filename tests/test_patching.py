"""tim_plugins.patching.Patch, the one reversible patch both adapters use (TRL's hooks, the HF recorder): after
``undo`` (or the ``with`` block, also when it raises) the owner holds exactly what it held before, for an instance,
a class and a module, and other objects of the class never see the patch."""

from __future__ import annotations

import logging
import types

import pytest

from tim_plugins.patching import Patch


class Owner:
    def method(self, x):
        return x + 1


def test_instance_patch_is_the_instance_s_only_and_undone_exactly():
    a, b = Owner(), Owner()
    p = Patch(a, "method", lambda original: lambda x: original(x) * 10)
    assert a.method(1) == 20 and b.method(1) == 2  # the bound original is TRL's own method; b is untouched
    assert "method" in vars(a) and "method" not in vars(Owner()) and p.label == "Owner.method"
    p.undo()
    assert "method" not in vars(a) and a.method(1) == 2
    p.undo()  # idempotent
    assert "method" not in vars(a)


def test_an_own_attribute_is_restored_not_deleted():
    a = Owner()
    own = lambda x: -x  # noqa: E731
    a.method = own
    with Patch(a, "method", lambda original: lambda x: original(x) + 100):
        assert a.method(1) == 99
    assert vars(a)["method"] is own


def test_undone_when_the_block_raises_for_a_class_and_a_module():
    module = types.ModuleType("fake_module")
    module.f = lambda: "original"
    before = Owner.__dict__["method"]
    with pytest.raises(KeyboardInterrupt):
        with Patch(Owner, "method", lambda original: lambda self, x: "patched"), \
                Patch(module, "f", lambda original: lambda: "patched"):
            assert Owner().method(1) == "patched" and module.f() == "patched"
            raise KeyboardInterrupt
    assert Owner.__dict__["method"] is before and Owner().method(1) == 2 and module.f() == "original"


def test_re_patched_by_someone_else_warns_and_restores_the_state_before_ours(caplog):
    a = Owner()
    p = Patch(a, "method", lambda original: lambda x: 0)
    a.method = lambda x: "theirs"
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        p.undo()
    assert "Owner.method was re-patched by someone else" in caplog.text
    assert "method" not in vars(a) and a.method(1) == 2


@pytest.mark.parametrize("order", ["first_then_second", "second_then_first"])
def test_two_of_our_patches_on_one_attribute_restore_the_original_in_either_order(order, caplog):
    """Two trainers in one process patch the same class and module attribute (two threads); their undos come in
    any order: after both the original is back, with no warning (both are ours), and while one is on, its
    wrapper is the one called."""
    module = types.ModuleType("fake_module")
    module.f = lambda: "original"
    before = Owner.__dict__["method"]
    first = [Patch(Owner, "method", lambda original: lambda self, x: ("first", original(self, x))),
             Patch(module, "f", lambda original: lambda: ("first", original()))]
    second = [Patch(Owner, "method", lambda original: lambda self, x: ("second", original(self, x))),
              Patch(module, "f", lambda original: lambda: ("second", original()))]
    assert Owner().method(1) == ("second", ("first", 2)) and module.f() == ("second", ("first", "original"))
    undos = first + second if order == "first_then_second" else second + first
    with caplog.at_level(logging.WARNING, logger="tim_plugins"):
        for p in undos[:2]:
            p.undo()
        if order == "first_then_second":  # the second stays on until undone (the first's wrapper inside it)
            assert Owner().method(1)[0] == "second" and module.f()[0] == "second"
        else:
            assert Owner().method(1) == ("first", 2) and module.f() == ("first", "original")
        for p in undos[2:]:
            p.undo()
    assert Owner.__dict__["method"] is before and Owner().method(1) == 2 and module.f() == "original"
    assert "re-patched" not in caplog.text


def test_a_patch_nobody_holds_does_not_keep_its_object_alive():
    """The registry of live patches holds them weakly: a trainer dropped with its patches still on (never
    detached) is collected, model and all."""
    import gc
    import weakref

    a = Owner()
    Patch(a, "method", lambda original: lambda x: 0)  # not kept: as a callback dropped with its trainer
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None
