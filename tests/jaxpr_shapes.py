"""The array shapes a jaxpr computes, for tests that check an array never appears."""

import jax


def shapes(closed_jaxpr) -> set:
  """Shapes of every equation's outputs, recursively through scan / remat / pjit / custom-VJP
  bodies."""
  found = set()

  def walk(j):
    for eqn in j.eqns:
      found.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(closed_jaxpr.jaxpr)
  return found
