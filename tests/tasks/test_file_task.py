"""The file task: verl's parquet and TRL's JSONL as they are, held-out sets by file stem or a
seeded split, prompts rendered, and a run on the embedded model with a user's reward function
that resumes bit for bit and reports per held-out set."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grpo
from grpo_jax import configuration, errors, tasks, train
from grpo_jax.generate import prompts
from grpo_jax.run import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")
VERL_TRAIN = os.path.join(DATA, "verl_math_train.parquet")
VERL_TEST = os.path.join(DATA, "verl_math_test.parquet")
TRL_JSONL = os.path.join(DATA, "trl_prompts.jsonl")
TRL_REWARDS = os.path.join(DATA, "trl_rewards.py")


def task_config(**values):
  c = grpo.get_config("smoke")
  c.task.update(name="file", **values)
  return c


def test_verl_parquet_runs_as_it_is():
  task = tasks.make_task(task_config(data_path=VERL_TRAIN, eval_paths=VERL_TEST))
  assert task.num_train_problems() == 6  # make_task_files.TRAIN
  sets = task.eval_sets(10)
  assert list(sets) == ["verl_math_test"] and len(sets["verl_math_test"]) == 2
  first = task.train_problem(0)
  assert first.conversational and first.answer == "\\frac{3}{4}"
  prompts_, columns = task.reward_inputs([first, task.train_problem(1)])
  # The row's own prompt messages; every other column; "answer" the ground truth read.
  assert prompts_[0][0]["role"] == "user" and "1/2 + 1/4" in prompts_[0][0]["content"]
  assert columns["answer"] == ["\\frac{3}{4}", "5"]
  assert columns["reward_model"][1] == {"style": "rule", "ground_truth": "5"}
  assert columns["data_source"] == ["DigitalLearningGmbH/MATH-lighteval"] * 2
  assert columns["extra_info"][1] == {"split": "train", "index": 1}


class Template:
  """A tokenizer with a chat template: renders messages as 'role: content' lines."""

  chat_template = "role: content"

  def apply_chat_template(self, messages, tokenize, add_generation_prompt):
    assert not tokenize and add_generation_prompt
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class NoTemplate:
  chat_template = None


def test_prompts_are_rendered_with_the_chat_template_and_the_system_prompt():
  """TRL's JSONL mixes string and message prompts. Messages always go through the template
  (contents joined by a blank line without one); strings only with task.chat_template."""
  c = task_config(data_path=TRL_JSONL, system_prompt="Be brief.")
  task = tasks.make_task(c)
  by_prompt = {str(task.train_problem(i).prompt)[:20]: task.train_problem(i)
               for i in range(task.num_train_problems())}
  text = next(p for p in by_prompt.values() if not p.conversational)
  chat = next(p for p in by_prompt.values() if p.conversational)
  render = lambda tok, problem, flag=False: prompts.PromptStream(
      task, tok, 64, chat_template=flag).render(problem)
  # The row's own system message comes first, so the configured one is not added.
  assert render(Template(), chat) == ("system: Think step by step.\nuser: Solve x + 2 = 7.\n"
                                      "assistant:")
  assert render(NoTemplate(), chat) == "Think step by step.\n\nSolve x + 2 = 7."
  assert render(Template(), text) == f"Be brief.\n\n{text.prompt}"
  task_t = tasks.make_task(task_config(data_path=TRL_JSONL, system_prompt="Be brief.",
                                       chat_template=True))
  assert prompts.PromptStream(task_t, Template(), 64).render(text) == (
      f"system: Be brief.\nuser: {text.prompt}\nassistant:")


def test_no_held_out_file_holds_out_a_seeded_split(capsys):
  c = task_config(data_path=VERL_TRAIN)
  a, b = tasks.make_task(c), tasks.make_task(c)
  # 10% of 6 rows rounds to 1 (at least one).
  assert "holding out 1 of 6 rows" in capsys.readouterr().out
  held = a.eval_sets(10)["heldout"]
  assert len(held) == 1 and held == b.eval_sets(10)["heldout"]  # the same split every time
  train = [a.train_problem(i).answer for i in range(a.num_train_problems())]
  assert len(train) == 5 and held[0].answer not in train
  c.task.file.split_seed = 1
  other = tasks.make_task(c).eval_sets(10)["heldout"]
  assert other != held  # another seed, another row (for these 6 rows and seeds 0 / 1)


def test_the_task_name_is_inferred_from_the_rows(capsys):
  c = grpo.get_config("smoke")
  c.task.data_path = VERL_TRAIN
  configuration.validate(c)
  assert c.task.name == "file"
  assert "task.name=file" in capsys.readouterr().out


@pytest.mark.parametrize("values,message", [
    (dict(data_path=VERL_TRAIN, prompt_field="question"),
     r"config.task.data_path: .*no usable row \(6 do not fit the verl schema; first: row 1: "
     r"missing field 'question'\)"),
    (dict(data_path=TRL_JSONL, answer_field="level2"), "row 1: missing field 'level2'"),
    (dict(data_path=VERL_TRAIN, eval_paths=f"{VERL_TEST},{VERL_TEST}"),
     "config.task.eval_paths: .*verl_math_test.parquet is listed twice: name each held-out "
     "file once"),
    (dict(data_path=VERL_TRAIN, eval_paths="/nonexistent/math500.parquet"),
     "config.task.eval_paths: no such data file: /nonexistent/math500.parquet"),
    (dict(data_path=os.path.join(DATA, "README.md")), "unsupported data file extension '.md'"),
    (dict(), "the file task reads task.data_path"),
])
def test_bad_data_is_one_line(values, message):
  with pytest.raises(errors.ConfigError, match=message):
    tasks.make_task(task_config(**values))


def test_an_unreadable_file_is_one_line_and_nothing_is_written(tmp_path):
  bad = tmp_path / "broken.parquet"
  bad.write_bytes(b"PAR1 not really")
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.train", "--config=configs/grpo.py:smoke",
       f"--config.task.data_path={bad}", "--config.task.name=file", f"--workdir={workdir}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"grpo_jax.train: config.task.data_path: {bad} is not a readable Parquet file")
  assert "Traceback" not in proc.stderr
  assert not workdir.exists()


def _config(total: int):
  """GRPO on the embedded model with the verl parquet, TRL-written rewards from their file (a
  curriculum on ``trainer_state``, one that only logs) and the format reward (weights 1, 1,
  0.5); advantages from the score so tiny groups differ."""
  c = grpo.get_config("smoke")
  c.task.update(data_path=VERL_TRAIN, eval_paths=VERL_TEST,
                rewards=(f"{TRL_REWARDS}:curriculum_length_penalty,{TRL_REWARDS}:token_counts,"
                         "format"),
                reward_weights="1,1,0.5", success_reward="format", success_threshold=1.0)
  # rollout.prompt_len stays the smoke preset's 24: 2 of the 6 training prompts fit (rows 4
  # and 6, 24 tokens; the others, 25-28, are skipped and counted), both held-out ones (24, 24).
  c.rl.reward_signal = "score"
  c.total_steps, c.eval.every, c.checkpoint.every = total, 100, 1  # evaluations at 0 and the end
  c.eval.greedy = False  # one sampler fewer to compile
  return c


def test_a_run_with_a_user_reward_resumes_bit_for_bit_and_reports_per_set(tmp_path):
  straight, resumed = os.fspath(tmp_path / "straight"), os.fspath(tmp_path / "resumed")
  train.train_and_evaluate(_config(2), straight)
  train.train_and_evaluate(_config(1), resumed)  # "killed" after 1 step ...
  train.train_and_evaluate(_config(2), resumed)  # ... and started again
  steps = lambda w: [r for r in metrics.read_metrics(w) if "loss" in r]
  sa, sb = steps(straight), steps(resumed)
  assert [r["step"] for r in sa] == [r["step"] for r in sb] == [1, 2]
  for key in ("loss", "reward_mean", "rollouts", "completion_tokens", "reward/format_mean",
              "reward/curriculum_length_penalty_mean", "reward/mean_tokens"):
    assert [r[key] for r in sa] == [r[key] for r in sb], key
  # The curriculum saw trainer_state, restored on resume: global_step 0 of 2 for step 1's batch
  # (no penalty), 1 of 2 for step 2's: -0.01 x tokens x 1/2, 8 tokens at most (smoke's T).
  assert sa[0]["reward/curriculum_length_penalty_mean"] == 0.0
  assert -0.04 - 1e-6 <= sa[1]["reward/curriculum_length_penalty_mean"] < 0
  # log_metric: the step's mean token count, which the run's own counters also give.
  for r, before in zip(sa, [0] + [r["completion_tokens"] for r in sa]):
    assert r["reward/mean_tokens"] == pytest.approx((r["completion_tokens"] - before) / 4)
  # log_extra: a completions file per step, a row per rollout (2 prompts x 2 in smoke).
  for step in (1, 2):
    table = _jsonl(os.path.join(straight, "completions", f"step_{step:06d}.jsonl"))
    assert len(table) == 4
    assert all(0 <= r["tokens"] <= 8 and r["token_counts"] is None for r in table)
  evals = [r for r in metrics.read_metrics(straight) if "eval/mean_at_2" in r]
  assert [r["step"] for r in evals] == [0, 2]
  assert all("eval/verl_math_test/mean_at_2" in r and "eval/verl_math_test/pass_at_2" in r
             and 0 < r["eval/verl_math_test/reward/mean_tokens"] <= 8 for r in evals)
  table = _jsonl(os.path.join(straight, "completions", "eval_000002.jsonl"))
  assert {r["set"] for r in table} == {"verl_math_test"} and len(table) == 2 * 2
  # One held-out set: the pooled metrics are that set's.
  assert all(r["eval/mean_at_2"] == r["eval/verl_math_test/mean_at_2"] for r in evals)
  la, lb = _params(straight), _params(resumed)
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(x, y)
  summary = open(os.path.join(straight, "report", "summary.md"), encoding="utf-8").read()
  assert "| straight | verl_math_test |" in summary


def _jsonl(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _params(workdir):
  """The leaves of the newest checkpoint's state, as numpy arrays."""
  from tests.run.test_train import _final_state  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(_final_state(workdir))]


def test_trl_jsonl_rows_that_do_not_fit_are_skipped_and_counted(capsys):
  task = tasks.make_task(task_config(data_path=TRL_JSONL))
  out = capsys.readouterr().out
  # trl_prompts.jsonl: 5 lines, an empty prompt and a line that is not JSON are skipped.
  assert "skipped 2 of 5 row(s) that do not fit the trl schema (first: row 3: 'prompt' is " \
         "empty)" in out
  answers = sorted(str(task.train_problem(i).answer) for i in range(task.num_train_problems())
                   ) + [str(p.answer) for p in task.eval_sets(5)["heldout"]]
  assert sorted(answers) == ["4", "\\frac{3}{4}", "x = 5"]


def test_a_reward_that_always_raises_stops_the_run_in_one_line(tmp_path):
  """Counted and said once per batch until task.max_reward_failures (2) all-failed batches in
  a row; then one line, exit 1, no traceback."""
  broken = tmp_path / "broken_reward.py"
  broken.write_text("def grade(completions, **kwargs):\n    raise KeyError('solution')\n")
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.train", "--config=configs/grpo.py:smoke",
       f"--config.task.data_path={VERL_TRAIN}", f"--config.task.rewards={broken}:grade",
       "--config.task.max_reward_failures=2",
       # The signal and evaluation of _config: the steps the resumed run above compiled.
       "--config.rl.reward_signal=score", "--config.eval.greedy=false",
       f"--workdir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "grpo_jax.train: every reward function failed on 2 batches in a row (last: grade: raised "
      "KeyError: 'solution'); nothing of this step was trained on and the checkpoints are as "
      "they were")
  assert "reward 'grade' raised KeyError: 'solution'" in proc.stdout  # said once, on the way


def test_a_held_out_set_is_its_first_prompts_that_fit(tmp_path, capsys):
  """The training file as a held-out set, eval.num_prompts=1: rows 1-3 (28, 25, 25 tokens) do
  not fit 24, row 4 (24) is the set; 4 of the 6 are said to be left out."""
  from grpo_jax.run import build  # pylint: disable=g-import-not-at-top
  c = _config(1)
  c.task.eval_paths = f"{VERL_TEST},{VERL_TRAIN}"
  c.eval.num_prompts = 1
  run = build.setup(c, os.fspath(tmp_path / "run"))
  assert "4 of 6 prompts of held-out set 'verl_math_train' are longer" in capsys.readouterr().out
  assert [p.answer for p in run.setup.eval_sets["verl_math_train"]] == ["12"]  # row 4: 3 * 4
  assert [p.answer for p in run.setup.eval_sets["verl_math_test"]] == ["4"]
  run.setup.ckpt.close()


TRL_TARGET = os.path.join(DATA, "trl_prompts_target.jsonl")


def test_a_reference_under_another_name_is_refused_until_named():
  """TRL rows {prompt, target}: the reader looks for answer / solution / ground_truth, finds
  none, and math would score every row None (bad_gold) and train on nothing. Refused before
  training, naming the fields the rows have; with task.answer_field=target they run."""
  from grpo_jax.rewards import scoring  # pylint: disable=g-import-not-at-top
  c = task_config(data_path=TRL_TARGET, rewards="math")
  task = tasks.make_task(c)
  with pytest.raises(errors.ConfigError, match=(
      r"config.task.answer_field: the math reward compares with the column\(s\) 'answer', but no "
      r"training row of the file task has a value there \(their fields: target; "
      r"task.answer_field=''\): name the reference's field")):
    scoring.make_scorer(c, task)
  c.task.answer_field = "target"
  scorer = scoring.make_scorer(c, tasks.make_task(c))
  held = scorer.task.eval_sets(None)["heldout"]
  assert sorted(p.answer for p in scorer.task.train + held) == sorted(
      ["5", "\\frac{9}{2}", "42", "25\\%"])
  # A held-out file without references is refused too, named.
  c = task_config(data_path=TRL_JSONL, eval_paths=TRL_TARGET, rewards="math")  # 'solution'
  with pytest.raises(errors.ConfigError, match="no held-out 'trl_prompts_target' row"):
    scoring.make_scorer(c, tasks.make_task(c))


def test_a_held_out_split_always_leaves_training_rows(tmp_path):
  """3 rows at eval_fraction 0.9: round(2.7) = 3 would hold out every row (and divide by zero
  later); at most len - 1 = 2 are held out, 1 trains. 2 rows at 0.5: 1 and 1."""
  path = tmp_path / "three.jsonl"
  path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(3)))
  c = task_config(data_path=os.fspath(path))
  c.task.file.eval_fraction = 0.9
  task = tasks.make_task(c)
  assert (task.num_train_problems(), len(task.eval_sets(None)["heldout"])) == (1, 2)


def test_a_held_out_file_may_be_called_anything(tmp_path):
  """``heldout.jsonl`` as the only held-out file is that set (the automatic split's name only
  applies without one); two files with one stem in different folders get their folder as a
  prefix; the same file twice is refused in one line that says what to do."""
  for folder in ("a", "b"):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "heldout.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
  one = os.fspath(tmp_path / "a" / "heldout.jsonl")
  task = tasks.make_task(task_config(data_path=TRL_JSONL, eval_paths=one))
  assert list(task.eval_sets(None)) == ["heldout"]
  two = f"{one},{tmp_path / 'b' / 'heldout.jsonl'}"
  task = tasks.make_task(task_config(data_path=TRL_JSONL, eval_paths=two))
  assert list(task.eval_sets(None)) == ["a_heldout", "b_heldout"]
  with pytest.raises(errors.ConfigError, match=r"config.task.eval_paths: .*heldout.jsonl is "
                     r"listed twice: name each held-out file once"):
    tasks.make_task(task_config(data_path=TRL_JSONL, eval_paths=f"{one},{one}"))
