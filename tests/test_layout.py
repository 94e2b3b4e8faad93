"""The package's layout: every import runs one way between the stages, and no module is in a
circle, read from the source of every module (imports inside functions included).

The stages, lowest first (``grpo_jax/<stage>/__init__.py`` says what each owns):
the shared modules at the top level, ``models``, ``tasks``, ``generate``, ``rewards``, ``rl``,
``allocation``, ``configuration`` (the validator reads every component) beside ``schema`` (the
config's keys, defaults and presets) and ``settings`` (what validation returns, typed), ``run``, and the command lines (``train``, ``export``,
``sft``, ``report``) with ``bench`` above them. A module may import its own stage and the stages
below it, never one above.
"""

import ast
import os
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "grpo_jax"
SHARED = ("__init__", "types", "random_keys", "registry", "errors", "console", "timing",
          "deprecated", "sharding", "distributed", "assets")
ORDER = [SHARED, ("models",), ("tasks",), ("generate",), ("rewards",), ("rl",), ("allocation",),
         ("configuration", "schema", "settings"), ("run",), ("train", "export", "sft", "report"), ("bench",)]
RANK = {name: rank for rank, names in enumerate(ORDER) for name in names}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the package."""
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
  """The package's modules that ``name`` imports (``from pkg import sub`` resolves to the
  submodule when it is one, else to the package)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("grpo_jax")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_jax"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        out.add(sub if sub in MODULES else node.module)
  out.discard(name)
  return {m for m in out if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def stage(module: str) -> str:
  """``grpo_jax.rl.replay.popo`` -> ``rl``; ``grpo_jax.sharding`` -> ``sharding``."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_stage():
  assert not sorted({stage(m) for m in MODULES} - set(RANK))


def test_no_import_runs_back_up():
  upward = sorted(f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
                  if RANK[stage(b)] > RANK[stage(a)])
  assert not upward


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_module_is_in_a_circle():
  assert not _circles(GRAPH)


def test_the_checks_see_an_import_that_runs_back_up_and_a_circle():
  # The graph as read, plus one import from models up to rl and one pair that import each other.
  graph = {m: set(d) for m, d in GRAPH.items()}
  graph["grpo_jax.models.hf"].add("grpo_jax.rl.step")
  assert RANK[stage("grpo_jax.rl.step")] > RANK[stage("grpo_jax.models.hf")]
  graph["grpo_jax.rl.losses"].add("grpo_jax.rl.update")
  assert "grpo_jax.rl.losses" in graph["grpo_jax.rl.update"] or any(
      "grpo_jax.rl.losses" in c for c in _circles(graph))
  assert any({"grpo_jax.rl.losses", "grpo_jax.rl.update"} <= set(c) for c in _circles(graph))


@pytest.mark.parametrize("package", [p for p in sorted(os.listdir(PACKAGE))
                                     if (PACKAGE / p / "__init__.py").exists()])
def test_each_stage_says_what_it_owns(package):
  doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
  assert doc and len(doc.split()) >= 15, f"grpo_jax/{package}/__init__.py: no docstring"
