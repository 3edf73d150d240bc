"""The low-rank methods MoARa runs on ("hosts", the paper's cross-method study), one module each.

A host is a frozen dataclass of its settings subclassing :class:`Host`, whose methods tell the
core what it needs: the stages its target matrices run between ``decompose`` and ``recompose``
(:meth:`Host.stages`), the Adam of the other parameters (:meth:`Host.other_adam`), the learning
rate and weight decay after the direction (:meth:`Host.finish`), any coupling to the learning
rate (:meth:`Host.with_learning_rate`), its state types for ``state_bytes``
(``state_types``) and where its bases are for the alignment diagnostic (``basis_states``).
Adding a host is one module and one line of :data:`HOSTS`; from outside the package,
:func:`register_host` (or ``"package.module:Class"`` where a host name is asked for).
"""

from __future__ import annotations

import dataclasses
import importlib

from moara_jax.hosts._base import Host, StageOptions
from moara_jax.hosts.fira import Fira
from moara_jax.hosts.galore import GaLore
from moara_jax.hosts.ldadam import LDAdam
from moara_jax.hosts.osd import OSD
from moara_jax.hosts.q_galore import QGaLore
from moara_jax.hosts.subtrack_pp import SubTrackPP

HOSTS: dict[str, type[Host]] = {cls.name: cls for cls in (GaLore, Fira, QGaLore, OSD, LDAdam, SubTrackPP)}


def register_host(cls: type[Host]) -> type[Host]:
    """Adds a :class:`Host` subclass to :data:`HOSTS` under its ``name`` (usable as a class
    decorator); ``moara_adamw(host=name)`` and the trainer's ``optimizer.host`` then take it.
    Another class under a name taken is refused, but for the same class defined again (its
    module and qualified name the same: a notebook cell or a reloaded module run again), which
    replaces the one registered.

    Args:
      cls: a :class:`Host` subclass that is a dataclass, defines :meth:`Host.stages` and has a
        class attribute ``name`` (a non-empty string).

    Returns:
      ``cls`` itself, now in :data:`HOSTS` under ``cls.name``.

    Raises:
      TypeError: ``cls`` is no :class:`Host` subclass, no dataclass, or does not define
        ``stages``.
      ValueError: ``cls`` has no ``name``, or another class is registered under it.
    """
    if not (isinstance(cls, type) and issubclass(cls, Host)):
        raise TypeError(f"register_host takes a Host subclass, got {cls!r}")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(
            f"{cls.__name__} is not a dataclass: a host is a frozen dataclass of its settings "
            "(@dataclasses.dataclass(frozen=True))"
        )
    if cls.stages is Host.stages:
        raise TypeError(f"{cls.__name__} defines no stages(self, o): the stages its target matrices run")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute name (a non-empty string)")
    taken = HOSTS.get(name)
    if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"a host named {name!r} is already registered ({HOSTS[name].__name__})")
    HOSTS[name] = cls
    return cls


def host_class(spec: str) -> type[Host]:
    """The host class of a registered name, or of ``"package.module:Class"`` (imported and
    registered: how a host defined outside this package reaches the trainer's
    ``optimizer.host``); ``ValueError`` naming what is wrong."""
    if spec in HOSTS:
        return HOSTS[spec]
    if not (isinstance(spec, str) and ":" in spec):
        raise ValueError(f"unknown host {spec!r}: one of {', '.join(HOSTS)}, or package.module:Class")
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"host {spec!r} cannot be imported: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Host)):
        raise ValueError(f"host {spec!r} is not a moara_jax.Host subclass")
    try:
        return register_host(cls)
    except TypeError as e:
        raise ValueError(f"host {spec!r}: {e}") from None


def defined_hosts() -> list[type[Host]]:
    """Every :class:`Host` subclass defined in this process, registered or not (a host given to
    ``moara_adamw(host=...)`` as settings need not be): whose state types ``state_bytes`` sorts
    and whose bases the alignment diagnostic reads. One whose ``state_types`` is no tuple or
    whose ``basis_states`` no mapping (a draft, never used) is passed over."""
    found, todo = [], [Host]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return [h for h in found if isinstance(h.state_types, tuple) and isinstance(h.basis_states, dict)]


def resolve_host(host: str | Host) -> Host:
    """A host's settings from its name (with defaults) or as given; ``ValueError`` otherwise.

    Args:
      host: a :class:`Host` instance (its settings), the name of a registered host (a key of
        :data:`HOSTS`), or ``"package.module:Class"``, which is imported and registered
        (:func:`host_class`).

    Returns:
      ``host`` itself when it is a :class:`Host` instance, else an instance of the named host
      class made with its default settings.

    Raises:
      ValueError: for an unknown name, a ``"package.module:Class"`` that cannot be imported or
        registered or is no :class:`Host` subclass, a :class:`Host` class instead of an instance,
        or anything else.
    """
    if isinstance(host, Host):
        return host
    if isinstance(host, str) and (host in HOSTS or ":" in host):
        return host_class(host)()
    if isinstance(host, type) and issubclass(host, Host):
        raise ValueError(f"host={host.__name__} is a class: pass its settings, {host.__name__}()")
    raise ValueError(f"host must be one of {tuple(HOSTS)} or a host settings object, got {host!r}")


__all__ = [
    "HOSTS",
    "OSD",
    "Fira",
    "GaLore",
    "Host",
    "LDAdam",
    "QGaLore",
    "StageOptions",
    "SubTrackPP",
    "defined_hosts",
    "host_class",
    "register_host",
    "resolve_host",
]
