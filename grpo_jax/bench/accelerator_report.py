"""The accelerator check's report: one line per point as it ends, and ``accelerator.md``, the
table of every point (environment, parity, train steps, decode, rollouts, the update padded and
packed). ``bench/accelerator.py`` runs the points and writes both after each one.
"""

from __future__ import annotations

import math

MIB = 2 ** 20
GIB = 2 ** 30


def _fmt(v, spec: str, scale: float = 1.0, none: str = "n/a") -> str:
  """``v / scale`` formatted, or ``none`` for a missing or non-finite value."""
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return none
  return format(v if scale == 1 else v / scale, spec)


def point_line(pt: dict) -> str:
  """One line for a point that just ended (or was not started)."""
  head = f"[{pt.get('ended_s', 0):5.0f} s] {pt['id']}"
  r = pt.get("result") or {}
  if pt["status"] != "ok":
    why = {"timeout": f"timed out after {pt.get('seconds', 0):.0f} s "
                      f"({'budget' if pt.get('limit') == 'budget' else 'its cap'})",
           "failed": f"failed: {pt.get('error', '')}"}.get(pt["status"], pt["status"])
    return f"{head}: {why}"
  kind = pt["spec"]["kind"]
  if kind == "env":
    return (f"{head}: {r['device_kind']} ({r['backend']}, {r['device_count']} device(s)), "
            f"{_fmt(r['memory_bytes_limit'], '.1f', GIB)} GiB, jax {r['jax']}, HBM "
            f"{_fmt(r['hbm_bytes_per_s'], '.0f', 1e9)} GB/s, copy "
            f"{_fmt(r['copy_bytes_per_s'], '.0f', 1e9)} GB/s")
  if kind == "parity":
    return f"{head}: " + ("; ".join(
        f"{x['kernel']} vs blocked: out {x['max_out_diff']:.3g} grad {x['max_grad_diff']:.3g} "
        f"at padding {x['max_at_padding']:.3g} finite {x['finite']}" for x in r["parity"])
                          or "no fused kernel on this backend")
  if kind == "train":
    return (f"{head}: {r['train_tokens_per_s']:.0f} tok/s, step {r['train_s']:.2f} s, MFU "
            f"{_fmt(r['train_mfu'], '.1%')}, prox {r['prox_pass']}, peak "
            f"{_fmt(r['device_peak_bytes'], '.0f', MIB)} MiB, compile {r['compile_s']:.0f} s")
  if kind == "decode":
    return (f"{head}: {r['tokens_per_s']:.0f} tok/s, {1e3 * r['step_s']:.2f} ms/step, "
            f"{r['bytes_per_step'] / 1e9:.3g} GB/step, {_fmt(r['hbm_fraction'], '.1%')} of HBM, "
            f"peak {_fmt(r['device_peak_bytes'], '.0f', MIB)} MiB, compile "
            f"{r['compile_s']:.0f} s")
  return f"{head}: {r.get('summary', '')}"


def markdown(result: dict) -> str:
  """accelerator.md: the environment, parity, then one table per part and what was not
  measured."""
  env = result.get("env") or {}
  lines = ["# Accelerator check", "",
           f"Status: {result['status']} after {result['elapsed_s']:.3g} s of a "
           f"{result['budget_s']:.3g} s budget. {result.get('message', '')}".rstrip(), ""]
  if env:
    lines.append(f"{env['device_kind']} ({env['backend']}, {env['device_count']} device(s)), "
                 f"memory limit {_fmt(env['memory_bytes_limit'], '.1f', GIB)} GiB; jax "
                 f"{env['jax']}, jaxlib {env['jaxlib']}, cuDNN {_fmt(env['cudnn'], 'd')}; "
                 f"bf16 peak {_fmt(env['bf16_peak_flops'], '.0f', 1e12)} TFLOP/s, HBM "
                 f"{_fmt(env['hbm_bytes_per_s'], '.0f', 1e9)} GB/s (specification), copy "
                 f"{_fmt(env['copy_bytes_per_s'], '.0f', 1e9)} GB/s (measured: bytes read + "
                 "written).")
  lines.append("Packages: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
  lines.append("Environment: " + (", ".join(f"{k}={v}" for k, v in result["environ"].items())
                                  or "no XLA / JAX variables set"))
  cache = result["compilation_cache"]
  lines += [f"Compilation cache: {cache['dir'] or 'off'} ({cache['entries_before']} entries "
            f"before, {cache.get('entries_after', '?')} after).", ""]
  done = [pt for pt in result["points"] if pt["status"] == "ok"]
  for pt in done:
    if pt["spec"]["kind"] == "parity":
      for x in pt["result"]["parity"]:
        lines.append(f"Parity {x['kernel']} vs blocked {x['shape']}: output "
                     f"{x['max_out_diff']:.3g}, gradients {x['max_grad_diff']:.3g} (bf16; scales "
                     f"{x['ref_out_scale']:.3g}, {x['ref_grad_scale']:.3g}); at padding "
                     f"{x['max_at_padding']:.3g} (0 expected), finite {x['finite']}.")
      if not pt["result"]["parity"]:
        lines.append("Parity: no fused kernel on this backend.")
  trains = [pt["result"] for pt in done if pt["spec"]["kind"] == "train"]
  if trains:
    lines += ["", "Train steps (bf16 matmuls, float32 master weights, layer remat; synthetic "
              "rollouts of T tokens; MFU: model FLOPs of the step, prox pass included, over "
              "the chip's bf16 specification):", "",
              "| method | attention (ran) | N | P | T | lengths, packing (useful fraction) "
              "| prox pass | step s | tokens/s | MFU | planned MiB | device peak MiB "
              "| compile s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['attention']} ({r['resolved']}) | {r['rows']} | {r['P']} | "
              f"{r['T']} | {r.get('lengths', 'full')}, {r.get('packing', 'none')} "
              f"({_fmt(r.get('update_useful_fraction'), '.3f')}) | "
              f"{r['prox_pass']} | {r['train_s']:.3g} | "
              f"{r['train_tokens_per_s']:.0f} | {_fmt(r['train_mfu'], '.1%')} | "
              f"{_fmt(r['planned_step_bytes'], '.0f', MIB)} | "
              f"{_fmt(r['device_peak_bytes'], '.0f', MIB)} | {r['compile_s']:.0f} |"
              for r in trains]
  decodes = [pt["result"] for pt in done if pt["spec"]["kind"] == "decode"]
  if decodes:
    lines += ["", "Decode (the sampler, EOS off; bytes: hbm.decode_bytes' floor, weights once "
              "per step + the filled KV slots; fractions of the HBM specification and of the "
              "measured copy, lower bounds):", "",
              "| N | P | T | attention (ran) | tokens/s | ms / step | GB / step | of HBM "
              "| of copy | planned MiB | device peak MiB | compile s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['P']} | {r['T']} | {r['attention']} ({r['resolved']}) | "
              f"{r['tokens_per_s']:.0f} | {1e3 * r['step_s']:.3g} | "
              f"{r['bytes_per_step'] / 1e9:.3g} | {_fmt(r['hbm_fraction'], '.1%')} | "
              f"{_fmt(r['copy_fraction'], '.1%')} | {_fmt(r['planned_bytes'], '.0f', MIB)} | "
              f"{_fmt(r['device_peak_bytes'], '.0f', MIB)} | {r['compile_s']:.0f} |"
              for r in decodes]
  for pt in done:
    if pt["spec"]["kind"] == "rollouts":
      lines += ["", f"Rollouts, static batch vs partial (bench.rollouts): "
                    f"{pt['result']['summary']}."]
  tests = [pt for pt in done if pt["spec"]["kind"] == "tests"]
  for pt in tests:
    lines += ["", f"Tests: {pt['result']['summary']} ({pt['seconds']:.0f} s)."]
  rest = [pt for pt in result["points"] if pt["status"] != "ok"]
  if rest:
    lines += ["", "Not measured:", ""]
    lines += [f"- {point_line(pt).split('] ', 1)[1]}" for pt in rest]
  return "\n".join(lines) + "\n"
