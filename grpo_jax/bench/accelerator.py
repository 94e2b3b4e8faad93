"""The accelerator check: one command for the first minutes on a GPU or TPU.

On the first device. The workplace's device tool lends one H200 for 15 minutes of device time
a task (its start, 1 to 2 minutes, included) and at most 10 minutes a command; its image has
JAX with the CUDA plugin and every package this imports but ``ml_collections``, which travels
as a wheel (pure Python; made once here with ``pip download --no-deps --only-binary=:all:
-d .whl ml-collections==1.1.0``, ``.whl/`` ignored through ``.git/info/exclude``). One call of
the tool's ``run`` with ``carry=[".whl"]`` and ``timeout_s=480``, from the repository root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site || exit; \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
      python3 -m grpo_jax.bench.accelerator --expect=gpu --out_dir=$OUT

The command ends by itself within ``--budget_s`` (420 s) and a few seconds, so the tool's
480 s is only a backstop; with the machine's start that leaves about 5 of the 15 minutes for
one rerun while the machine is still warm (30 s after the reply): the same command with
``--budget_s=240 --only=ID,...`` naming the points the first run did not finish (ids in its
lines and table) and ``timeout_s=300``. The rerun finds the compilation cache the first run
filled (``~/.cache/grpo_jax/jax`` on that machine), so what was compiled before costs nothing.
The memory fraction: each point's process is alone on the device, so it may take more than
JAX's default 75% (the preset's 512 rows decode with a 75 GB bf16 KV cache).
Anywhere (tests/bench/test_accelerator.py runs it on a CPU):

    python -m grpo_jax.bench.accelerator --tiny --notests --out_dir=/tmp/accel

It leaves in ``--out_dir`` three files: ``accelerator.json`` (everything: the environment,
each point's status, seconds and results), ``accelerator.md`` (the tables, and what was not
measured and why) and ``accelerator.log`` (every child's output: tracebacks, JAX's warnings).
The first two are rewritten after every point (a temporary file renamed over the old one), so
a kill at any moment leaves all that was measured; stdout gets one line per point as it ends,
and the tables last (the end of the output is what the tool's reply shows).

Every point runs in a child process of its own (``bench.accelerator_points``, started by
``bench.bounded``), killed with everything it
started when it outlives ``min(its cap, the budget left)`` (caps of 120 to 300 s: ``plan``); a
point killed by the budget ends the check, one killed by its cap does not, and none starts
with less than 20 s left. The parent never touches the
device, so each point's peak memory (``memory_stats()['peak_bytes_in_use']``) is its own. The
children share JAX's persistent compilation cache (``--cache_dir``, default
``grpo_jax.run.compilation_cache``'s ``~/.cache/grpo_jax/jax``): a rerun of the same command
compiles nothing that took over a second. The points, most important first:

1. **env**: device kind and count, memory, jax / jaxlib / plugin / cuDNN versions, XLA flags and
   the memory fraction, the chip's bf16 peak and HBM bandwidth by specification, and a
   measured device-to-device copy (bytes read + written per second). A CPU backend without
   ``--tiny`` stops here with one line (the full shapes would run for hours, and on a GPU
   machine it means the CUDA plugin did not load); so does any backend other than ``--expect``.
2. **parity**: the backend's fused kernel against ``blocked`` (``flash``): ``cudnn`` on a GPU,
   ``splash`` on a TPU (in Pallas' interpreter elsewhere, at the tiny shape), bf16, head width
   128, rows padded left, right, both sides and not at all: largest output and gradient
   differences over every position, what the kernel leaves at padded positions (0 expected).
3. **train**: the real bf16 configuration's GRPO train step (configs/grpo.py with the
   ``qwen3_0p6b`` preset: bf16 matmuls, float32 master weights and Adam, layer remat, query
   blocks of 256, 4 minibatches, attention ``auto`` = cudnn / splash, and so
   ``prox.rows="auto"`` resolved to "all": the extra no-grad pass a bf16 run makes) on a
   random Qwen3-0.6B-shaped model, ``--rows`` rows of synthetic rollouts (P 256, T 1,024, no
   EOS): tokens/s, model-FLOP utilisation against the chip's specification (the step is
   compute-bound), the compiled step's planned peak and the point's own device peak.
4. **decode**: the sampler at ``--decode_rows`` (256, then the preset's 512), P 256,
   T 1,024, EOS disabled: tokens/s, seconds per token step, the bytes each step must move
   (``hbm.decode_bytes``) and that rate as a fraction of the HBM bandwidth by specification and
   of the measured copy: decoding is bound by memory bandwidth, so no MFU here.
5. **rollouts**: the static batch against partial rollouts (``bench.rollouts``) at the longest
   ``--lengths`` (4,096), 64 rows, log-normal completion lengths by the benchmark's stop rule:
   the useful-slot fractions and generation time per useful token.
6. **larger**: the train step at the preset's 512 rows, at T 4,096, with the ``--attention``
   kernels (xla, blocked) instead of auto, and POPO (replay, the decoupled objective).
7. **tests**: ``pytest`` of the device-path test files, with whatever budget is left.

Exit status: 0 when the plan ran (points that timed out or failed are recorded as such), 2 on
a CPU without ``--tiny``, 3 when the backend is not ``--expect``'s, 4 when the environment
could not be read, 5 when a package the points import is missing (nothing measured but the
environment in these four cases).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import signal
import sys
import tempfile
import time

from absl import app, flags

from grpo_jax.bench import bounded
from grpo_jax.bench.accelerator_report import markdown, point_line

HANG_CAP_S = 3.0
# grpo_jax/schema/presets.py's qwen3 presets: 64 prompts x 8 rollouts per step.
PRESET_ROWS = 512
# A point started with less than this left could not load, compile and run a 0.6B step.
MIN_START_S = {False: 20.0, True: 0.0}
# Package names whose versions the check records (and names when the backend is wrong).
_PACKAGE_PREFIXES = ("jax", "libtpu", "flax", "optax", "nvidia-cudnn", "nvidia-cuda-runtime",
                     "ml-collections", "ml_collections", "numpy")
_ENV_VARS = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
             "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "JAX_DEFAULT_MATMUL_PRECISION",
             "JAX_COMPILATION_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")


# --- the plan -------------------------------------------------------------------------------

def _train(part, method, attention, n, g, p, t, cap, packing=None):
  """A train point; with ``packing`` on the workload's log-normal lengths, padded or packed."""
  spec = {"kind": "train", "method": method, "attention": attention, "rows": n, "group": g,
          "prompt_len": p, "completion_len": t}
  tail = ""
  if packing is not None:
    spec.update(packing=packing, lengths="lognormal")
    tail = f"_lognormal_{packing}"
  return {"id": f"train_{method}_{attention}_n{n}_t{t}{tail}", "part": part, "cap_s": cap,
          "spec": spec}


def _decode(n, g, p, t, cap):
  return {"id": f"decode_n{n}_t{t}", "part": "decode", "cap_s": cap,
          "spec": {"kind": "decode", "attention": "auto", "rows": n, "group": g,
                   "prompt_len": p, "completion_len": t}}


def _rollouts(n, g, p, t, cap):
  return {"id": f"rollouts_n{n}_t{t}", "part": "rollouts", "cap_s": cap,
          "spec": {"kind": "rollouts", "rows": n, "group": g, "prompt_len": p,
                   "completion_len": t}}


def plan(tiny: bool, rows: int, decode_rows, lengths, kernels, g: int, p: int,
         tests: bool) -> list[dict]:
  """The points in the order they run, most important first: {"id", "part", "cap_s", "spec"}.

  Caps (seconds) bound each point on its own, so that no single shape can take the whole
  budget (a point never gets more than the budget left either). At the full shapes they are
  guesses, generous ones, until a device has run the check: a child's start and CUDA
  initialisation, a jitted init, the compiles (tens of seconds each for the 0.6B step) and two
  calls."""
  points = [{"id": "env", "part": "env", "cap_s": 120.0, "spec": {"kind": "env"}},
            {"id": "parity", "part": "parity", "cap_s": 150.0, "spec": {"kind": "parity"}}]
  if tiny:
    n, g, p, t = 8, 2, 8, 16
    points += [_train("train", "grpo", "auto", n, g, p, t, 120.0),
               _decode(n, g, p, t, 60.0), _decode(n // 2, g, p, t, 60.0),
               _rollouts(n, g, p, 64, 120.0),
               _train("larger", "popo", "auto", n, g, p, t, 120.0)]
  else:
    t = lengths[0]
    points.append(_train("train", "grpo", "auto", rows, g, p, t, 240.0))
    points += [_decode(n, g, p, t, 180.0) for n in decode_rows]
    points.append(_rollouts(64, g, p, lengths[-1], 240.0))  # static vs partial at the longest T
    # The update at the real tokens against the padded one, on the same log-normal lengths.
    points += [_train("update", "grpo", "auto", 64, g, p, lengths[-1], 200.0, packing=k)
               for k in ("none", "tokens")]
    if PRESET_ROWS != rows:
      points.append(_train("larger", "grpo", "auto", PRESET_ROWS, g, p, t, 300.0))
    points += [_train("larger", "grpo", "auto", rows, g, p, longer, 300.0)
               for longer in lengths[1:]]
    points += [_train("larger", "grpo", k, rows, g, p, t, 200.0) for k in kernels]
    points.append(_train("larger", "popo", "auto", rows, g, p, t, 200.0))
  if tests:
    points.append({"id": "tests", "part": "tests", "cap_s": 1e9, "spec": {"kind": "tests"}})
  return points


def package_versions() -> dict:
  """{distribution: version} of JAX, its plugins (jax-cuda*-plugin / -pjrt, libtpu) and the
  libraries a step needs, from the installed metadata (no import)."""
  found = {}
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name.startswith(_PACKAGE_PREFIXES):
      found[name] = dist.version
  return dict(sorted(found.items()))


def env_problem(env: dict, expect: str, tiny: bool, versions: dict) -> tuple[int, str, str]:
  """(exit status, status, one line) when the check must not go on in the environment the
  first child read, else (0, "", "")."""
  backend = env["backend"]
  jaxes = ", ".join(f"{k} {v}" for k, v in versions.items()
                    if k.startswith(("jax", "libtpu"))) or "no jax distribution found"
  plugins = [k for k in versions
             if (k.startswith("jax") and ("cuda" in k or "rocm" in k)) or k.startswith("libtpu")]
  cause = (f"installed: {jaxes}; " + ("no CUDA / TPU plugin is installed" if not plugins else
           "the plugin did not load: its version must match jaxlib's, and its import warning "
           "in accelerator.log says why"))
  if expect and backend != expect:
    return 3, "wrong backend", f"expected the {expect} backend, JAX runs on {backend} ({cause})"
  if backend == "cpu" and not tiny:
    return 2, "refused", (f"refusing the full shapes on a CPU (hours; pass --tiny for the "
                          f"script's CPU check). If this machine has an accelerator: {cause}")
  if env["missing_packages"]:
    return 5, "missing packages", (
        f"missing on this machine: {', '.join(env['missing_packages'])}; every point imports "
        "it (pip install it, or carry its wheel)")
  return 0, "", ""


# --- the parent -----------------------------------------------------------------------------

class Check:
  """The parent: runs the plan point by point, rewriting the JSON and the table after each.

  Args:
    out_dir: where accelerator.json / .md / .log go.
    points: ``plan``'s.
    budget_s: the wall-clock bound of the whole check.
    tiny: the toy shapes (a CPU is then allowed).
    cache_dir: JAX's compilation cache folder of the children ('' = off).
    expect: the backend JAX must run on ('' = any).
    test_files: pytest's files of the tests point.
    hang: a point id whose child sleeps until it is killed at ``HANG_CAP_S`` (tests).
  """

  def __init__(self, out_dir: str, points: list[dict], budget_s: float, tiny: bool,
               cache_dir: str, expect: str = "", test_files=(), hang: str = ""):
    self.out_dir, self.tiny, self.budget_s = out_dir, tiny, budget_s
    self.expect, self.test_files, self.hang = expect, list(test_files), hang
    os.makedirs(out_dir, exist_ok=True)
    self.log = os.path.join(out_dir, "accelerator.log")
    self.start = time.monotonic()
    cache = cache_dir
    self.result = {
        "check": "grpo_jax.bench.accelerator", "argv": sys.argv, "tiny": tiny,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "budget_s": budget_s, "elapsed_s": 0.0, "status": "running", "message": "",
        "versions": package_versions(),
        "environ": {k: os.environ[k] for k in _ENV_VARS if k in os.environ},
        "compilation_cache": {"dir": cache, "entries_before": _entries(cache)},
        "env": None,
        "points": [{**pt, "status": "pending"} for pt in points]}
    self.child_env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
    with open(self.log, "w", encoding="utf-8") as f:
      f.write(f"accelerator check {self.result['started']}: {' '.join(sys.argv)}\n")
    self.save()

  def elapsed(self) -> float:
    return time.monotonic() - self.start

  def save(self) -> None:
    """accelerator.json and accelerator.md, each replaced whole."""
    self.result["elapsed_s"] = self.elapsed()
    cache = self.result["compilation_cache"]
    cache["entries_after"] = _entries(cache["dir"])
    bounded.write_atomic(os.path.join(self.out_dir, "accelerator.json"),
                         json.dumps(self.result, indent=1))
    bounded.write_atomic(os.path.join(self.out_dir, "accelerator.md"), markdown(self.result))

  def finish(self, status: str, message: str = "") -> None:
    for pt in self.result["points"]:
      if pt["status"] in ("pending", "running"):
        pt["status"] = "not started" if pt["status"] == "pending" else "terminated"
    self.result.update(status=status, message=message)
    self.save()

  def run_one(self, pt: dict, timeout_s: float, limit: str) -> None:
    """One point in a child bounded by ``timeout_s``; its result (or why none) into ``pt``."""
    pt.update(status="running", timeout_s=timeout_s, limit=limit)
    self.save()
    spec = dict(pt["spec"])
    with tempfile.TemporaryDirectory(prefix="grpo_jax_point_") as tmp:
      result_path = os.path.join(tmp, "result.json")
      if spec["kind"] == "tests":
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-n", "0",
                "-p", "no:cacheprovider", *self.test_files]
      else:
        spec["tiny"] = self.tiny
        if pt["id"] == self.hang:
          spec["hang"] = True
        argv = [sys.executable, "-m", "grpo_jax.bench.accelerator_points", json.dumps(spec),
                result_path, str(time.time() + timeout_s + 5.0)]
      env = {**self.child_env,
             "GRPO_JAX_ACCELERATOR_ENV": json.dumps({
                 k: v for k, v in (self.result["env"] or {}).items()
                 if k in ("copy_bytes_per_s", "hbm_bytes_per_s")})}
      outcome = bounded.run_point(argv, timeout_s, self.log, env=env, title=pt["id"])
      pt.update(status=outcome["status"], seconds=outcome["seconds"], ended_s=self.elapsed())
      if outcome["status"] == "failed":
        pt["error"] = outcome["last_line"]
      if spec["kind"] == "tests" and outcome["status"] != "timeout":
        pt.update(status="ok", result={"summary": outcome["last_line"],
                                       "returncode": outcome["returncode"]})
      elif outcome["status"] == "ok":
        with open(result_path, encoding="utf-8") as f:
          pt["result"] = json.load(f)
    if pt["id"] == "env" and pt["status"] == "ok":
      self.result["env"] = pt["result"]
    self.save()
    print(point_line(pt), flush=True)

  def run(self, only: list[str]) -> int:
    """Runs the plan within the budget; returns the exit status."""
    min_start = MIN_START_S[self.tiny]
    for pt in self.result["points"]:
      if only and pt["id"] != "env" and pt["id"] not in only:
        pt["status"] = "not selected"
        continue
      left = self.budget_s - self.elapsed()
      if left < max(min_start, 0.01):
        self.finish("budget spent", f"budget spent: {self._count('pending')} point(s) not "
                                    "started")
        print(f"accelerator check: {self.result['message']}", flush=True)
        return 0
      cap = HANG_CAP_S if pt["id"] == self.hang else pt["cap_s"]
      self.run_one(pt, min(cap, left), "cap" if cap <= left else "budget")
      if pt["id"] == "env":
        code = self._check_env(pt)
        if code:
          return code
      if pt["status"] == "timeout" and pt["limit"] == "budget":
        self.finish("budget spent", f"budget spent in {pt['id']}: "
                                    f"{self._count('pending')} point(s) not started")
        print(f"accelerator check: {self.result['message']}", flush=True)
        return 0
    self.finish("done", f"{self._count('ok')} point(s) measured, "
                        f"{len(self.result['points']) - self._count('ok')} not")
    return 0

  def _count(self, status: str) -> int:
    return sum(pt["status"] == status for pt in self.result["points"])

  def _check_env(self, pt: dict) -> int:
    """The exit status (and its one line on stderr) when the check cannot go on."""
    if pt["status"] != "ok":
      why = (f"not read within {pt['seconds']:.1f} s ({pt['limit']})"
             if pt["status"] == "timeout" else f"not read: {pt.get('error', '')}")
      code, line = 4, f"the environment was {why}; nothing measured (see {self.log})"
      status = "no environment"
    else:
      code, status, line = env_problem(pt["result"], self.expect, self.tiny,
                                       self.result["versions"])
    if code:
      self.finish(status, line)
      print(f"accelerator check: {line}", file=sys.stderr, flush=True)
    return code


def _cache_dir(flag: str) -> str:
  """The compilation cache folder the children use ('' = off)."""
  if flag == "none":
    return ""
  if flag:
    return os.path.abspath(flag)
  from grpo_jax.run import compilation_cache  # pylint: disable=g-import-not-at-top
  path = os.environ.get(compilation_cache.ENV)
  return compilation_cache.default_dir() if path is None else path


def _entries(path: str) -> int:
  """Files in the cache folder (0 when off or absent)."""
  if not path or not os.path.isdir(path):
    return 0
  return sum(len(files) for _, _, files in os.walk(path))

def define_flags() -> None:
  """Defines the check's flags; called only when this module is the program.

  ``bench.memory`` and the other benchmarks define some of the same names (``group_size``,
  ``prompt_len``), and tests import this module beside them for ``env_problem``.
  """
  flags.DEFINE_string("out_dir", "runs/accelerator",
                      "where accelerator.json / .md / .log go")
  flags.DEFINE_bool("tiny", False, "toy shapes (a CPU check of the script itself)")
  flags.DEFINE_enum("expect", "", ["", "gpu", "tpu", "cpu"],
                    "fail in one line unless JAX's backend is this one")
  flags.DEFINE_float("budget_s", 420.0,
                     "wall-clock bound of the whole check; each point gets at most what "
                     "is left")
  flags.DEFINE_bool("tests", True, "run the device-path test files last")
  flags.DEFINE_list(
      "test_files", ["tests/models/test_attention.py", "tests/models/test_models.py", "tests/generate/test_sampler.py"],
      "test files of the last part")
  flags.DEFINE_integer("rows", 128, "N rows of the train steps (the larger part adds the "
                       "preset's 512)")
  flags.DEFINE_list("decode_rows", ["256", "512"], "N rows of the decode points")
  flags.DEFINE_list("lengths", ["1024", "4096"],
                    "completion lengths T: the first for every part, the others for "
                    "larger train steps")
  flags.DEFINE_list("attention", ["xla", "blocked"],
                    "kernels of the larger part's train steps, against auto")
  flags.DEFINE_integer("group_size", 8, "G")
  flags.DEFINE_integer("prompt_len", 256, "P")
  flags.DEFINE_list("only", [], "run only these point ids (env always runs)")
  flags.DEFINE_string("cache_dir", "", "JAX's compilation cache ('' = "
                      "grpo_jax.run.compilation_cache's folder, 'none' = off)")
  flags.DEFINE_string("simulate_hang", "", "tests: this point's child sleeps instead of "
                      "measuring and is killed after 3 s, as a point that outlives "
                      "its time would be")


def main(argv):
  del argv
  f = flags.FLAGS
  tiny = f.tiny
  points = plan(tiny, f.rows, [int(x) for x in f.decode_rows],
                [int(x) for x in f.lengths], f.attention, f.group_size,
                f.prompt_len, f.tests)
  check = Check(f.out_dir, points, f.budget_s, tiny, _cache_dir(f.cache_dir),
                expect=f.expect, test_files=f.test_files, hang=f.simulate_hang)

  def stop(signum, frame):
    """Killed from outside (a tool's timeout): the child first, then the files, then out."""
    del frame
    bounded.kill_running()
    check.finish("terminated", f"stopped by signal {signum}")
    sys.exit(128 + signum)

  signal.signal(signal.SIGTERM, stop)
  signal.signal(signal.SIGINT, stop)
  code = check.run(f.only)
  if code == 0:
    print(markdown(check.result), flush=True)
  return code


if __name__ == "__main__":
  define_flags()
  app.run(main)
