"""Name -> component tables, filled by the components themselves, and config groups read from
their dataclass fields.

A component module registers itself::

    METHODS = registry.Registry("replay method", package="grpo_jax.rl.replay")

    @METHODS.register("popo")
    @dataclasses.dataclass(frozen=True)
    class Popo(registry.Configurable):
      slots: int = 0  # becomes config.replay.popo.slots, default 0
      objective: str = dataclasses.field(default="decoupled", metadata=registry.DERIVED)

A registry that names its ``package`` imports every module of that package on first lookup, so
a new component is its module (plus, usually, a config file): nothing else lists it.
``Configurable.config_group()`` turns the dataclass's own fields into the ml_collections group
that ``base_config`` installs (``config.replay.popo``), and ``from_group`` reads it back, so a
field's name, default and meaning live in one place.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Generic, Iterator, TypeVar

import ml_collections

T = TypeVar("T")

# Field metadata of a dataclass field that is not read from the component's own config group
# (set from another group, e.g. the shared ``replay.objective``, or computed).
DERIVED = {"config": False}


class Registry(Generic[T]):
  """An ordered name -> component table.

  Args:
    kind: what the components are, for error messages ("replay method").
    package: a package whose modules are imported before the first lookup (each registers
      itself at import); None when every component is registered by an import elsewhere.
  """

  def __init__(self, kind: str, package: str | None = None):
    self.kind = kind
    self._package = package
    self._entries: dict[str, T] = {}
    self._loaded = package is None

  def register(self, name: str) -> Callable[[T], T]:
    """Decorator: registers the decorated object under ``name`` (unique)."""
    def add(obj: T) -> T:
      if name in self._entries and self._entries[name] is not obj:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._entries[name] = obj
      return obj
    return add

  def _load(self) -> None:
    if self._loaded:
      return
    self._loaded = True
    package = importlib.import_module(self._package)
    for info in pkgutil.iter_modules(package.__path__):
      importlib.import_module(f"{self._package}.{info.name}")

  def get(self, name: str) -> T:
    """The component registered as ``name``.

    Raises:
      KeyError: naming the known components.
    """
    self._load()
    if name not in self._entries:
      raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
    return self._entries[name]

  def names(self) -> tuple[str, ...]:
    self._load()
    return tuple(self._entries)

  def items(self) -> Iterator[tuple[str, T]]:
    self._load()
    return iter(list(self._entries.items()))

  def __contains__(self, name: str) -> bool:
    self._load()
    return name in self._entries


class Configurable:
  """Mixin for frozen dataclasses whose config group is their own fields.

  Every field without ``metadata=DERIVED`` is a config field: its name is the key, its default
  the default. A field without a default has no group default and must be derived.
  """

  @classmethod
  def config_fields(cls) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("config", True))

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    """The defaults of this component's own config group."""
    group = ml_collections.ConfigDict()
    for f in cls.config_fields():
      if f.default is dataclasses.MISSING:
        raise TypeError(f"{cls.__name__}.{f.name}: a config field needs a default")
      group[f.name] = f.default
    return group

  @classmethod
  def from_group(cls, group, **derived: Any):
    """An instance from its config group (a ConfigDict or mapping) and the derived fields.

    Keys of ``group`` that are not fields are an error: a typo must not pass silently.
    """
    group = group if group is not None else {}
    names = {f.name for f in cls.config_fields()}
    unknown = sorted(set(group.keys()) - names)
    if unknown:
      raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return cls(**{k: group[k] for k in names if k in group}, **derived)
