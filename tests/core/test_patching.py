"""The shared patch mechanics: version guard, all-or-nothing application, undo, loud activation."""
import logging
import types

import pytest

from faircast_plugins.patching import FairCastPatchError, PatchSet, is_patched, require_version, resolve


class Target:
    def method(self):
        return "original"

    @staticmethod
    def static():
        return "static"


class Child(Target):
    pass


def test_require_version_names_the_installed_version():
    assert require_version("pytest", ">=1")
    with pytest.raises(FairCastPatchError, match=r"installed pytest is \d"):
        require_version("pytest", "<1")
    with pytest.raises(FairCastPatchError, match="not installed"):
        require_version("surely-not-a-real-distribution-xyz", ">=1")


def test_resolve_reports_the_missing_piece():
    owner, attr, value = resolve(f"{__name__}:Target.method")
    assert owner is Target and attr == "method"
    with pytest.raises(FairCastPatchError, match="has no attribute 'gone'"):
        resolve(f"{__name__}:Target.gone")
    with pytest.raises(FairCastPatchError, match="cannot import"):
        resolve("no_such_module_xyz:thing")


def test_apply_wraps_and_remove_restores(caplog):
    ps = PatchSet("pytest-as-framework", "pytest", ">=1")
    ps.wrap(f"{__name__}:Target.method", lambda orig: lambda self: "patched+" + orig(self))
    ps.wrap(f"{__name__}:Child.method", lambda orig: lambda self: "child+" + orig(self))
    with caplog.at_level(logging.WARNING, logger="faircast_plugins"):
        ps.apply(details="mode=stochastic")
    assert "Fair Cast ACTIVE for pytest-as-framework" in caplog.text and "Target.method" in caplog.text
    assert Target().method() == "patched+original"
    assert Child().method() == "child+patched+original"
    assert is_patched(Target.__dict__["method"])
    ps.remove()
    assert Target().method() == "original" and Child().method() == "original"
    assert "method" not in Child.__dict__  # an inherited attribute is deleted again, not frozen


def test_a_missing_target_patches_nothing():
    ps = PatchSet("pytest-as-framework", "pytest", ">=1")
    ps.wrap(f"{__name__}:Target.method", lambda orig: lambda self: "patched")
    ps.wrap(f"{__name__}:Target.renamed_in_v2", lambda orig: orig)
    with pytest.raises(FairCastPatchError, match=r"cannot patch pytest-as-framework \d.*renamed_in_v2"):
        ps.apply()
    assert Target().method() == "original" and not ps.active


def test_unsupported_version_patches_nothing():
    ps = PatchSet("pytest-as-framework", "pytest", "<1").wrap(f"{__name__}:Target.method", lambda o: o)
    with pytest.raises(FairCastPatchError, match="supports pytest<1"):
        ps.apply()
    assert not ps.active


def test_staticmethod_descriptor_is_kept_and_module_functions_patch():
    mod = types.ModuleType("fc_fake_mod")
    mod.fn = lambda: 1
    import sys
    sys.modules["fc_fake_mod"] = mod
    try:
        ps = PatchSet("pytest-as-framework", "pytest", ">=1")
        ps.wrap(f"{__name__}:Target.static", lambda orig: staticmethod(lambda: "new " + orig.__func__()))
        ps.wrap("fc_fake_mod:fn", lambda orig: lambda: orig() + 1)
        ps.apply()
        assert Target.static() == "new static" and mod.fn() == 2
        ps.remove()
        assert Target.static() == "static" and mod.fn() == 1
    finally:
        del sys.modules["fc_fake_mod"]


def test_apply_called_again_by_an_import_hook_while_it_runs_patches_once(monkeypatch):
    """``apply`` imports the targets' modules; a post-import hook there (the verl plugin's) calls ``apply`` again.
    Each target must be wrapped once, and the set stay applied."""
    import importlib.abc
    import importlib.util
    import sys

    ps = PatchSet("pytest-as-framework", "pytest", ">=1")

    class HookedLoader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            module.fn = lambda: 1
            ps.apply()  # what the hook does right after the module ran

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, HookedLoader()) if name == "fc_hooked_mod" else None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "fc_hooked_mod", raising=False)
    ps.wrap(f"{__name__}:Target.method", lambda orig: lambda self: "patched+" + orig(self))
    ps.wrap("fc_hooked_mod:fn", lambda orig: lambda: orig() + 1)
    try:
        ps.apply()
        assert ps.active and Target().method() == "patched+original" and sys.modules["fc_hooked_mod"].fn() == 2
        ps.apply()  # idempotent
        assert Target().method() == "patched+original"
    finally:
        ps.remove()
        sys.modules.pop("fc_hooked_mod", None)
    assert Target().method() == "original"
