"""Shared monkeypatch mechanics for every framework adapter.

One place for the three things each adapter needs:

* a version guard (:func:`require_version`) that names the installed version when it refuses, with one explicit
  opt-in for newer, unverified releases (:data:`ALLOW_UNVERIFIED_ENV`, gated by :func:`self_check`, which runs
  ``faircast doctor`` in a subprocess);
* symbol resolution (:func:`resolve`) that fails loudly when a patch target is missing;
* a :class:`PatchSet` that checks *every* target before touching any, installs wrappers, can undo them,
  and logs one loud activation line.

A patch that does not take effect must never be silent, so nothing here swallows a missing symbol.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger("faircast_plugins")


class FairCastPatchError(RuntimeError):
    """A framework patch could not be applied (missing symbol, unsupported version)."""


def installed_version(distribution: str) -> str | None:
    """Version string of an installed distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


#: The one opt-in for framework releases newer than the verified range: a comma-separated list of distributions
#: (``trl``, ``verl``, ``openrlhf``, ``deepspeed``, ``torch``, ``megatron-core``) or ``all``. Fair Cast then still runs only when
#: every patch target resolves and the ``faircast doctor`` self-check passes on the installed stack.
ALLOW_UNVERIFIED_ENV = "FAIRCAST_ALLOW_UNVERIFIED"
#: Set by ``faircast doctor`` in its own process: the doctor is the self-check, so it patches unverified
#: (newer) releases to test them without asking for the opt-in, and does not start itself again.
DOCTOR_ENV = "FAIRCAST_DOCTOR"


def unverified_allowed(distribution: str) -> bool:
    """True when :data:`ALLOW_UNVERIFIED_ENV` names ``distribution`` (or ``all``)."""
    names = {n.strip().lower() for n in os.environ.get(ALLOW_UNVERIFIED_ENV, "").split(",") if n.strip()}
    return "all" in names or distribution.lower() in names


#: distribution -> the ``faircast doctor`` checks that run its patched path (names in
#: :data:`faircast_plugins.doctor.CHECKS`): the releases :data:`ALLOW_UNVERIFIED_ENV` can allow, through :func:`self_check`
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "trl": ("trl",),
    "verl": ("fsdp",),
    "openrlhf": ("deepspeed",),
    "deepspeed": ("deepspeed",),
    "torch": ("fsdp",),
    "megatron-core": ("megatron",),
}
SELF_CHECK_TIMEOUT_S = 600
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")

_passed: set = set()


def self_check(distribution: str, version: str) -> None:
    """The gate of :data:`ALLOW_UNVERIFIED_ENV`: ``faircast doctor DISTRIBUTION`` must pass on this stack (run once
    per process, in a subprocess at world size 1, so the check's process group and patches never touch the
    caller's). Raises :class:`FairCastPatchError` otherwise."""
    if distribution not in FRAMEWORKS:
        raise FairCastPatchError(
            f"{ALLOW_UNVERIFIED_ENV} names {distribution}, but faircast doctor has no self-check for it, so an "
            f"unverified {distribution} {version} cannot be allowed; install a verified release"
        )
    if distribution in _passed:
        return
    # A plain single process: a launcher's rank variables (torchrun, Ray, DeepSpeed) would make the checks join its
    # process group.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env[DOCTOR_ENV] = "1"
    cmd = [sys.executable, "-m", "faircast_plugins.cli", "doctor", distribution]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SELF_CHECK_TIMEOUT_S)
        failed, output = proc.returncode != 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        failed, output = True, f"timed out after {SELF_CHECK_TIMEOUT_S} s"
    if failed:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise FairCastPatchError(
            f"{ALLOW_UNVERIFIED_ENV} allows the unverified {distribution} {version}, but its self-check "
            f"`faircast doctor {distribution}` failed on this stack, so Fair Cast refuses to run on it:\n{tail}"
        )
    _passed.add(distribution)


def _spec_sets(specifier: str) -> list:
    """A specifier is one PEP 440 specifier set, or several joined by ``||`` (any of them: exact releases that ran)."""
    return [SpecifierSet(part.strip(), prereleases=True) for part in specifier.split("||")]


def version_matches(version: str, specifier: str) -> bool:
    return any(Version(version) in spec for spec in _spec_sets(specifier))


def _newer_than_verified(version: str, specifier: str) -> bool:
    """True when ``version`` is not verified but above a verified range (past its upper bound, or between two
    verified releases of a ``||`` union), not below all of them."""
    if version_matches(version, specifier):
        return False
    lower = [[s for s in spec if s.operator in (">=", ">", "==", "~=")] for spec in _spec_sets(specifier)]
    return any(all(Version(version) > Version(s.version) for s in bounds) for bounds in lower)


def check_version(distribution: str, specifier: str, *, framework: str | None = None) -> tuple[str, bool]:
    """``(installed version, verified)``: raise if ``distribution`` is missing or outside ``specifier``, unless it
    is newer and opted in with :data:`ALLOW_UNVERIFIED_ENV` (or checked by ``faircast doctor``): then
    ``verified`` is False and the caller must run the self-check (:meth:`PatchSet.check` does)."""
    name = framework or distribution
    version = installed_version(distribution)
    if version is None:
        raise FairCastPatchError(
            f"Fair Cast for {name} needs the '{distribution}' package ({specifier}), which is not installed."
        )
    if version_matches(version, specifier):
        return version, True
    newer = _newer_than_verified(version, specifier)
    if newer and (unverified_allowed(distribution) or os.environ.get(DOCTOR_ENV)):
        return version, False
    msg = (
        f"Fair Cast supports {distribution}{specifier}; the installed {distribution} is {version}. "
        f"Its patch points have not been verified for {version}, so Fair Cast refuses to run rather than "
        f"silently leave the export or the loss on a round-to-nearest copy."
    )
    if newer:
        msg += (
            f" To run on it anyway, set {ALLOW_UNVERIFIED_ENV}={distribution} (on every node): Fair Cast then "
            f"proceeds only if every patch target resolves and `faircast doctor {distribution}` passes on this stack."
        )
    else:
        msg += f" Upgrade {distribution} to the verified range."
    raise FairCastPatchError(msg)


def require_version(distribution: str, specifier: str, *, framework: str | None = None) -> str:
    """Return the installed version of ``distribution`` or raise if it is missing or outside ``specifier`` (the
    strict guard: no opt-in; see :func:`check_version`)."""
    version, verified = check_version(distribution, specifier, framework=framework)
    if not verified:
        raise FairCastPatchError(f"Fair Cast supports {distribution}{specifier}; the installed {distribution} is {version}")
    return version


def resolve(path: str) -> tuple[Any, str, Any]:
    """Resolve ``"package.module:Class.attr"`` to ``(owner, attr_name, current_value)``.

    Raises :class:`FairCastPatchError` naming the missing piece.
    """
    module_name, _, qualname = path.partition(":")
    if not qualname:
        raise ValueError(f"patch target {path!r} must look like 'package.module:Attr[.attr]'")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FairCastPatchError(f"cannot import {module_name} for patch target {path}: {exc}") from exc
    parts = qualname.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise FairCastPatchError(f"patch target {path}: {owner!r} has no attribute {part!r}")
        owner = getattr(owner, part)
    attr = parts[-1]
    # Look in the class dict first so staticmethod/classmethod descriptors are kept as they are.
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return owner, attr, vars(klass)[attr]
        raise FairCastPatchError(f"patch target {path}: class {owner.__qualname__} has no attribute {attr!r}")
    if not hasattr(owner, attr):
        raise FairCastPatchError(f"patch target {path}: {owner!r} has no attribute {attr!r}")
    return owner, attr, getattr(owner, attr)


_MISSING = object()


@dataclass
class _Applied:
    owner: Any
    attr: str
    previous: Any  # value in owner.__dict__ before patching, or _MISSING if it was inherited


@dataclass
class PatchSet:
    """A named group of patches for one framework, applied and removed together.

    ``framework`` is the human name, ``distribution`` the pip name and ``specifier`` the supported range.
    Each :meth:`wrap` registers ``target -> factory(original)``; nothing is touched before :meth:`apply`,
    which first checks the version and resolves every target, so a half-applied patch set cannot happen.
    """

    framework: str
    distribution: str
    specifier: str
    _wanted: list[tuple[str, Callable[[Any], Any]]] = field(default_factory=list)
    _applied: list[_Applied] = field(default_factory=list)
    version: str | None = None
    verified: bool = True
    _applying: bool = False

    def wrap(self, target: str, factory: Callable[[Any], Any]) -> "PatchSet":
        """Register a patch: ``factory(original)`` returns the replacement for ``target``."""
        self._wanted.append((target, factory))
        return self

    @property
    def active(self) -> bool:
        return bool(self._applied)

    @property
    def targets(self) -> list[str]:
        return [t for t, _ in self._wanted]

    def check(self) -> str:
        """Check the installed version and that every target exists. Returns the version.

        A newer release opted in with :data:`ALLOW_UNVERIFIED_ENV` passes only when every target resolves and the
        ``faircast doctor`` self-check for it passes on this stack; it is then logged loudly as unverified."""
        self.version, self.verified = check_version(self.distribution, self.specifier, framework=self.framework)
        missing = []
        for target, _ in self._wanted:
            try:
                resolve(target)
            except FairCastPatchError as exc:
                missing.append(str(exc))
        if missing:
            raise FairCastPatchError(
                f"Fair Cast cannot patch {self.framework} {self.version}: "
                + "; ".join(missing)
                + f". Supported: {self.distribution}{self.specifier}."
            )
        if not self.verified:
            self._check_unverified()
        return self.version

    def _check_unverified(self) -> None:
        if os.environ.get(DOCTOR_ENV):
            return  # this is the doctor's process: it is the self-check
        self_check(self.distribution, self.version)
        logger.warning(
            "Fair Cast UNVERIFIED: %s %s is outside the verified range %s%s; running because %s=%s, every patch "
            "target resolved and `faircast doctor %s` passed on this stack. Watch the faircast/* metrics.",
            self.framework, self.version, self.distribution, self.specifier, ALLOW_UNVERIFIED_ENV,
            os.environ.get(ALLOW_UNVERIFIED_ENV, ""), self.distribution,
        )

    def apply(self, *, details: str = "") -> "PatchSet":
        """Check everything, then install every wrapper. Idempotent, and a no-op when called again while it runs:
        :meth:`check` imports the targets' modules, whose post-import hooks (the verl plugin's) may call it, and
        that nested call must neither wrap the targets a second time nor be undone by this one."""
        if self.active or self._applying:
            return self
        self._applying = True
        try:
            self.check()
            for target, factory in self._wanted:
                owner, attr, original = resolve(target)
                previous = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else original
                replacement = factory(original)
                _mark(replacement, target)
                setattr(owner, attr, replacement)
                self._applied.append(_Applied(owner, attr, previous))
        except BaseException:
            self.remove()
            raise
        finally:
            self._applying = False
        if not self.verified:
            details = f"UNVERIFIED {self.distribution} {self.version} (verified: {self.specifier})" + (
                f"; {details}" if details else "")
        log_activation(self.framework, self.version, self.targets, details)
        return self

    def remove(self) -> None:
        """Undo every applied patch, newest first."""
        while self._applied:
            item = self._applied.pop()
            if item.previous is _MISSING:
                delattr(item.owner, item.attr)
            else:
                setattr(item.owner, item.attr, item.previous)


@contextlib.contextmanager
def temporarily(owner: Any, attr: str, value: Any):
    """Set ``owner.attr = value`` for the duration of a ``with`` block, then restore it exactly.

    For overrides scoped to one call (DeepSpeed's copy-back intercepts ``torch.Tensor.copy_`` only while
    its optimizer step runs); framework patches that stay installed belong in a :class:`PatchSet`.
    """
    previous = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, previous)


def _mark(obj: Any, target: str) -> None:
    func = getattr(obj, "__func__", obj)
    try:
        func.__faircast_patch__ = target
    except (AttributeError, TypeError):
        pass


def is_patched(obj: Any) -> bool:
    """True when ``obj`` (a function or descriptor) was installed by a :class:`PatchSet`."""
    return hasattr(getattr(obj, "__func__", obj), "__faircast_patch__")


def log_activation(framework: str, version: str | None, targets: list[str], details: str = "") -> None:
    """One loud line per activation, at WARNING so it shows under default logging configs."""
    msg = f"Fair Cast ACTIVE for {framework} {version}: patched {len(targets)} symbol(s) [{', '.join(targets)}]"
    if details:
        msg += f"; {details}"
    logger.warning(msg)
