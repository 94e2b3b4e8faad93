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
from typing import Any, Callable, ClassVar, Generic, Iterator, TypeVar

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


class GroupError(ValueError):
  """A value of a config group out of range, with the path of its key inside the group.

  ``str()`` is ``"path.to.key: message"`` (just the message when the path is empty);
  ``under("config.rl")`` is the one line a config check prints.
  """

  def __init__(self, path, message: str):
    self.path, self.message = tuple(path), message
    super().__init__(f"{'.'.join(self.path)}: {message}" if self.path else message)

  def within(self, key: str) -> "GroupError":
    """The same error one group further out (``key`` prefixed to the path)."""
    return GroupError((key, *self.path), self.message)

  def under(self, prefix: str) -> str:
    """The error's line for a group at ``prefix`` (e.g. ``config.rl``)."""
    return f"{'.'.join((prefix, *self.path))}: {self.message}"


def _within(key: str, error: ValueError) -> GroupError:
  if isinstance(error, GroupError):
    return error.within(key)
  return GroupError((key,), str(error))


def _name_of(table: "Registry", component_: Any) -> str:
  """The name under which ``component_``'s class is registered in ``table``."""
  return next(name for name, cls in table.items() if type(component_) is cls)


def component(table: "Registry", default: Any) -> Any:
  """A dataclass field holding a registered component of ``table`` (``default``: an instance).

  In the config group the field's key names the component (``config.rl.estimator = "grpo"``)
  and every registered component with fields has its own subgroup beside it
  (``config.rl.grpo.eps``); ``from_group`` checks every subgroup and builds the named one.
  """
  return dataclasses.field(default=default, metadata={"component": table})


def nested(cls: type) -> Any:
  """A dataclass field holding a ``Configurable`` whose group nests in this one
  (``config.rl.loss`` for ``StepConfig.loss``); its default is ``cls()``."""
  return dataclasses.field(default=cls(), metadata={"group": cls})


class Configurable:
  """Mixin for frozen dataclasses whose config group is their own fields.

  Every field without ``metadata=DERIVED`` is a config field: its name is the key, its default
  the group's default (one default per key: the group's and the constructor's are the same). A
  ``component`` field is a registered component named by its key, with a subgroup per
  registered component; a ``nested`` field is a Configurable whose group nests under its key. A
  field without a default has no group default and must be derived. ``OTHERS`` names keys of
  the group that other parts of the program read (allowed in the group, not fields).
  """

  OTHERS: ClassVar[tuple[str, ...]] = ()

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
      if "component" in f.metadata:
        table = f.metadata["component"]
        group[f.name] = _name_of(table, f.default)
        for name, entry in table.items():
          sub = entry.config_group()
          if sub.keys():
            group[name] = sub
      elif "group" in f.metadata:
        group[f.name] = f.metadata["group"].config_group()
      else:
        group[f.name] = f.default
    return group

  @classmethod
  def from_group(cls, group, **derived: Any):
    """An instance from its config group (a ConfigDict or mapping) and the derived fields (a
    derived value replaces the group's, e.g. a resolved "auto").

    Keys of ``group`` that are not fields are an error: a typo must not pass silently.

    Raises:
      GroupError: an unknown key, an unknown component name or a value out of range, with
        the key's path inside the group.
    """
    group = group if group is not None else {}
    fields = cls.config_fields()
    names = {f.name for f in fields}
    subgroups = {n for f in fields if "component" in f.metadata
                 for n in f.metadata["component"].names()}
    unknown = sorted(set(group.keys()) - names - subgroups - set(cls.OTHERS))
    if unknown:
      raise GroupError((), f"unknown key(s) {', '.join(unknown)}; known: "
                       f"{', '.join(sorted(names | subgroups))}")
    values = {}
    for f in fields:
      if "component" in f.metadata:
        table = f.metadata["component"]
        built = {}
        for name, entry in table.items():  # every subgroup must hold values that run
          try:
            built[name] = entry.from_group(group.get(name))
          except ValueError as e:
            raise _within(name, e) from None
        name = group.get(f.name, _name_of(table, f.default))
        if name not in built:
          raise GroupError((f.name,), f"{name!r}; known: {', '.join(table.names())}")
        values[f.name] = built[name]
      elif "group" in f.metadata:
        try:
          values[f.name] = f.metadata["group"].from_group(group.get(f.name))
        except ValueError as e:
          raise _within(f.name, e) from None
      elif f.name in group:
        values[f.name] = group[f.name]
    values.update(derived)
    try:
      return cls(**values)
    except GroupError:
      raise
    except ValueError as e:
      raise GroupError((), str(e)) from None
