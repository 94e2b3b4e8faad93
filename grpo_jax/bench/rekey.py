"""Giving a sweep's older records the config they ran, from git (``sweep --rekey``).

Records written before records stored their config hold only the hash of the whole resolved
config (``config_match.whole_hash``), so a key added to the package since makes them stale.
Each names the code commit it ran (``code``). ``rekey`` rebuilds the cell's config at that
commit: its ``grpo_jax`` and ``configs`` folders from ``git archive``, the grid loaded from them
in a child process (the grid file as it was at the commit, else today's), and keeps a config
only where its whole hash is the record's ``config_hash``: then it is, bit for bit, the config
the record ran. The record gets it (``config``; ``rekeyed``: the old hash and the commit that
reproduced it) and today's hash of its choices; from then on it stands or not by
``config_match``'s rule, like a record written today. A record whose hash its commit does not
reproduce (its run had uncommitted changes to the config, or the commit is not in this
repository) is left as it is, as is one that stores its config already.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable

from grpo_jax.bench import config_match

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a child whose sys.path starts with the old tree: prints {spec: {cell id: [whole hash,
# config JSON]} or the error} for each grid spec that names the cells, with the same calls every
# version of bench/grid.py has had.
_CHILD = r"""
import json, os, sys
tree, specs, ids = sys.argv[1], sys.argv[2].split("\n"), set(sys.argv[3].split(","))
sys.path.insert(0, tree)
import configs, grpo_jax
for module in (configs, grpo_jax):
  assert module.__file__.startswith(tree), module.__file__
from grpo_jax.bench import grid as grid_lib
package = os.path.join(tree, "grpo_jax")
found = {}
for spec in specs:
  try:
    g = grid_lib.load(spec)
  except BaseException as e:
    found[spec] = f"{type(e).__name__}: {e}"
    continue
  found[spec] = {c.id: g.config(c).to_json(sort_keys=True).replace(package, "<grpo_jax>")
                 for c in g.cells() if c.id in ids}
print(json.dumps(found))
"""

# commit, grid spec, cell ids -> {cell id: its config's JSON at that commit}, or the reason why not
ConfigsAt = Callable[[str, str, list[str]], "dict[str, str] | str"]


def configs_at(commit: str, spec: str, cell_ids: list[str],
               repo: str = ROOT) -> dict[str, str] | str:
  """The cells' config JSON (package folder as ``<grpo_jax>``) as the code at ``commit`` built
  them, from the grid file at that commit where it names a cell, else from today's.

  Returns:
    {cell id: JSON text} (the ids neither grid file names left out), or one line why none.
  """
  archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit, "grpo_jax",
                            "configs"], capture_output=True, check=False)
  if archive.returncode:
    return f"git archive {commit[:12]}: {archive.stderr.decode().strip() or 'failed'}"
  path, sep, arg = spec.partition(":")
  then = os.path.join("{tree}", os.path.relpath(os.path.abspath(path), repo)) + sep + arg
  with tempfile.TemporaryDirectory() as tree:
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
      tar.extractall(tree, filter="data")
    specs = [then.format(tree=tree), os.path.abspath(path) + sep + arg]
    child = subprocess.run([sys.executable, "-c", _CHILD, tree, "\n".join(specs),
                            ",".join(cell_ids)], capture_output=True, text=True, check=False)
  if child.returncode:
    lines = child.stderr.strip().splitlines() or [f"exit code {child.returncode}"]
    return f"the grid at {commit[:12]}: {lines[-1]}"
  found: dict[str, str] = {}
  by_spec = json.loads(child.stdout.splitlines()[-1])
  for by_id in by_spec.values():
    if isinstance(by_id, dict):
      for cell_id, text in by_id.items():
        found.setdefault(cell_id, text)
  errors = [e.replace(tree, "<tree>") for e in by_spec.values() if isinstance(e, str)]
  return found or (f"the grid at {commit[:12]}: " + "; ".join(errors) if errors else found)


def added_by(folder: str, repo: str = ROOT) -> dict[str, str]:
  """File name -> the commit that (last) added it, for the files git tracks in ``folder``."""
  log = subprocess.run(["git", "-C", repo, "log", "--diff-filter=A", "--format=%H",
                        "--name-only", "--", os.path.abspath(folder)],
                       capture_output=True, text=True, check=False).stdout
  added, commit = {}, None
  for line in log.splitlines():
    if len(line) == 40 and "/" not in line:
      commit = line
    elif line.strip() and commit:
      added.setdefault(os.path.basename(line.strip()), commit)
  return added


def candidates(code: str, added: str | None, repo: str = ROOT, limit: int = 30) -> list[str]:
  """The commits a record's run may have run: its ``code`` commit, then (its run had
  uncommitted changes, ``+dirty``, or the hash is not the commit's) each commit from there to
  the one that added the record, oldest first, at most ``limit``."""
  commit = code.split("+")[0]
  if not added or added == commit:
    return [commit]
  later = subprocess.run(["git", "-C", repo, "rev-list", "--reverse", "--ancestry-path",
                          f"{commit}..{added}"], capture_output=True, text=True,
                         check=False).stdout.split()
  return [commit] + later[:limit]


def rekey_record(rec: dict, commit: str, text: str | None,
                 now: config_match.Current) -> dict | None:
  """The record with the config ``text`` (JSON) where that is the config it ran (its whole
  hash is the record's), with ``rekeyed`` and today's hash of its choices; else None."""
  if text is None or config_match.whole_hash(text) != rec.get("config_hash"):
    return None
  ran = config_match.flatten(json.loads(text))
  return dict(rec, config_hash=config_match.config_hash(ran, now.defaults),
              rekeyed={"from": rec["config_hash"], "commit": commit}, config=ran)


def rekey(recs: dict[str, dict], now: dict[str, config_match.Current], spec: str,
          commits: dict[str, list[str]],
          find: ConfigsAt = configs_at) -> tuple[dict[str, dict], dict[str, str]]:
  """Re-keys the done records without a stored config, trying their candidate commits in
  order, one ``find`` per commit for all the records whose next candidate it is.

  Args:
    recs: cell id -> its record.
    now: cell id -> its config today.
    spec: the grid spec (``path/to/grid.py[:arg]``).
    commits: cell id -> the commits to try (``candidates``).
    find: ``configs_at`` (a stand-in in tests).

  Returns:
    The re-keyed records by cell id, and for each record looked at one line: ``done``,
    ``stale: <paths that changed>``, or ``left: <why>``.
  """
  pending = {cell_id: list(commits.get(cell_id) or []) for cell_id, rec in recs.items()
             if rec.get("status") == "done" and "config" not in rec}
  rekeyed, verdicts, tried, why = {}, {}, {i: [] for i in pending}, {}
  while pending:
    empty = [i for i, queue in pending.items() if not queue]
    for cell_id in empty:
      shown = ", ".join(c[:12] for c in tried[cell_id]) or "none recorded"
      verdicts[cell_id] = (f"left: no config of its commits ({shown}) has its hash "
                           f"{recs[cell_id].get('config_hash')}"
                           + (f"; {why[cell_id]}" if cell_id in why else ""))
      del pending[cell_id]
    if not pending:
      break
    commit = next(iter(pending.values()))[0]
    ids = [i for i, queue in pending.items() if queue[0] == commit]
    found = find(commit, spec, ids)
    for cell_id in ids:
      pending[cell_id].pop(0)
      tried[cell_id].append(commit)
      if isinstance(found, str):
        why[cell_id] = found
        continue
      rec = rekey_record(recs[cell_id], commit, found.get(cell_id), now[cell_id])
      if rec is not None:
        rekeyed[cell_id] = rec
        changed = now[cell_id].changes(rec)
        verdicts[cell_id] = "done" if not changed else "stale: " + ", ".join(changed)
        del pending[cell_id]
  return rekeyed, verdicts
