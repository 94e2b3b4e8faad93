"""Reward functions in TRL's form and how the Scorer combines them: the built-ins, user
functions loaded by path or module (TRL-written ones unchanged), weights and the success
signal, and reward functions that fail in every way a user's code can."""

import os

import numpy as np
import pytest

from configs import grpo
from grpo_jax import errors
from grpo_jax.rewards import functions as rewards, scoring
from grpo_jax.tasks import countdown
from tests.rewards import test_math_answers

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
TRL_REWARDS = os.path.join(DATA, "trl_rewards.py")


class QA:
  """A task whose problems are (prompt, columns) pairs; no verifier of its own."""

  name = "qa"

  def __init__(self, conversational=False):
    self.conversational = conversational

  def train_problem(self, index):
    return ("What is 1 + 1?", {"ground_truth": "2"})

  def reward_inputs(self, problems):
    prompts = [[{"role": "user", "content": p}] if self.conversational else p
               for p, _ in problems]
    names = sorted({k for _, cols in problems for k in cols})
    return prompts, {k: [cols.get(k) for _, cols in problems] for k in names}


def rows(*answers):
  return [(f"q{i}", {"ground_truth": a, "answer": a}) for i, a in enumerate(answers)]


def test_builtin_rewards_by_hand():
  # gsm8k: the number after ####, else the last number; the reference may be "#### n".
  assert rewards.get("gsm8k")(["so #### 42", "it is 41", "no number"],
                              answer=["42", "Work... #### 41", "3"]) == [1.0, 1.0, 0.0]
  assert rewards.get("gsm8k")(["#### 1"], answer=[None]) == [None]  # no reference: no reward
  # countdown: 1.0 solved (3 + 4 = 7 uses exactly 3, 4), 0.1 well formed but wrong, 0.0 none.
  assert rewards.get("countdown")(["<answer>3 + 4</answer>", "<answer>3 * 4</answer>", "7"],
                                  nums=[[3, 4]] * 3, target=[7] * 3) == [1.0, 0.1, 0.0]
  assert rewards.get("countdown")(["<answer>3 + 4</answer>"]) == [None]
  # format: an answer in tags, every <think> closed.
  got = rewards.get("format")(["<think>a</think><answer>1</answer>", "<think>a <answer>1</answer>",
                               "\\boxed{2}", "2", [{"role": "assistant", "content": "\\boxed{3}"}]])
  assert got == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_math_reward_agrees_with_math_verify_on_every_case():
  """rewards.get("math") gives 1.0 exactly where math-verify's verdict is "correct", 0.0 for
  wrong and unparseable answers, None where the reference does not parse; and counts them."""
  golds, completions, verdicts = zip(*test_math_answers.CASES)
  fn = rewards.get("math", workers=2, timeout_s=10.0)
  try:
    got = fn(list(completions) + ["\\boxed{1}"], answer=list(golds) + [""])
    counts = fn.take_counts()
  finally:
    fn.close()
  assert got[:-1] == [1.0 if v == "correct" else 0.0 for v in verdicts]
  assert got[-1] is None  # an empty reference is bad_gold
  assert counts == {"unparseable": verdicts.count("unparseable"), "timeouts": 0, "bad_gold": 1}


def test_a_trl_reward_function_runs_unchanged():
  """boxed_matches is written for TRL (reads the ground_truth column, **kwargs for the rest):
  loaded from its file, called with prompts, completions, completion_ids and the columns."""
  name, fn = rewards.load(f"{TRL_REWARDS}:boxed_matches")
  assert name == "boxed_matches"
  scorer = scoring.Scorer(QA(), [(name, fn)])
  scores, success, failed = scorer.score(rows("2", "3"), ["\\boxed{2}", "\\boxed{2}"])
  np.testing.assert_array_equal(scores, [1.0, 0.0])
  np.testing.assert_array_equal(success, [True, False])
  assert not failed.any()
  assert scorer.take_stats() == {"reward/boxed_matches_failures": 0.0,
                                 "reward/boxed_matches_mean": 0.5}
  # Conversational prompts: the function receives each completion as a list of messages.
  _, says = rewards.load(f"{TRL_REWARDS}:says_answer")
  chat = scoring.Scorer(QA(conversational=True), [("says_answer", says)])
  np.testing.assert_array_equal(chat.score(rows("2", "2"), ["the answer", "no"])[0], [1.0, 0.0])


def test_weights_success_reward_and_threshold():
  """score = 1.0 * boxed + 0.5 * length; success from boxed alone (threshold 1)."""
  _, boxed = rewards.load(f"{TRL_REWARDS}:boxed_matches")
  _, length = rewards.load(f"{TRL_REWARDS}:length_penalty")
  scorer = scoring.Scorer(QA(), [("length", length), ("boxed", boxed)], [0.5, 1.0],
                          success_reward=1)
  scores, success, _ = scorer.score(rows("2", "3"), ["\\boxed{2}", "\\boxed{2}"],
                                    completion_ids=[[1, 2, 3, 4], [1, 2]])
  # Row 0: 1.0 * 1 + 0.5 * (-0.04) = 0.98; row 1: 1.0 * 0 + 0.5 * (-0.02) = -0.01.
  np.testing.assert_allclose(scores, [0.98, -0.01], rtol=1e-6)
  np.testing.assert_array_equal(success, [True, False])
  # The threshold decides: at 0.5 a partial value of 0.5 succeeds, at 1.0 it does not.
  half = lambda completions, **kw: [0.5] * len(completions)
  assert scoring.Scorer(QA(), [("half", half)], success_threshold=0.5).score(
      rows("2"), ["x"])[1].tolist() == [True]
  assert scoring.Scorer(QA(), [("half", half)]).score(rows("2"), ["x"])[1].tolist() == [False]
  # DAPO's score base: +1 / -1 from success, whatever the weights.
  dapo = scoring.Scorer(QA(), [("boxed", boxed)], [3.0], score_base="accuracy")
  np.testing.assert_array_equal(dapo.score(rows("2", "3"), ["\\boxed{2}"] * 2)[0], [1.0, -1.0])


def test_none_is_no_reward_and_never_a_success():
  """TRL's None (or NaN) adds nothing to the score and keeps the row out of success."""
  partial = lambda completions, **kw: [1.0, None, float("nan")]
  other = lambda completions, **kw: [0.25, 0.25, 0.25]
  scorer = scoring.Scorer(QA(), [("partial", partial), ("other", other)])
  scores, success, failed = scorer.score(rows("1", "1", "1"), ["a", "b", "c"])
  np.testing.assert_allclose(scores, [1.25, 0.25, 0.25])
  np.testing.assert_array_equal(success, [True, False, False])
  assert not failed.any()
  assert scorer.take_stats()["reward/partial_mean"] == 1.0  # the mean over rows with a value


@pytest.mark.parametrize("bad,why", [
    (lambda completions, **kw: 1 / 0, "raised ZeroDivisionError"),
    (lambda completions, **kw: [1.0], "returned 1 rewards for 2 completions"),
    (lambda completions, **kw: "1.0", "returned a str, not a list of 2 rewards"),
    (lambda completions, **kw: [1.0, "yes"], "returned 'yes' at row 1"),
    (lambda completions, **kw: [1.0, float("inf")], "returned inf at row 1"),
])
def test_a_failing_reward_is_counted_and_the_others_still_score(bad, why, capsys):
  good = lambda completions, **kw: [0.5, 1.0]
  scorer = scoring.Scorer(QA(), [("bad", bad), ("good", good)], success_reward=1)
  scores, success, failed = scorer.score(rows("1", "1"), ["a", "b"])
  np.testing.assert_allclose(scores, [0.5, 1.0])  # the failed function gives no value
  np.testing.assert_array_equal(success, [False, True])
  assert failed.all()  # a reward failed for these rows: counted in reward_errors
  assert why in capsys.readouterr().out  # said once, in one line
  scorer.score(rows("1", "1"), ["a", "b"])
  assert capsys.readouterr().out == ""  # ... only once
  assert scorer.take_stats()["reward/bad_failures"] == 2.0


def test_every_reward_failing_batch_after_batch_stops_the_run():
  """Three batches in a row on which every function fails stop; a good batch between resets
  the count (max_failed_batches=3: fail, fail, good, fail, fail is still going)."""
  state = {"fail": True}

  def flaky(completions, **kw):
    if state["fail"]:
      raise RuntimeError("the grader is down")
    return [1.0] * len(completions)

  scorer = scoring.Scorer(QA(), [("flaky", flaky)], max_failed_batches=3)
  for fail in (True, True, False, True, True):
    state["fail"] = fail
    scorer.score(rows("1"), ["a"])
  with pytest.raises(scoring.RewardError, match=r"every reward function failed on 3 batches "
                     r"in a row \(last: flaky: raised RuntimeError: the grader is down\)"):
    scorer.score(rows("1"), ["a"])
  # Evaluation (record=False) never counts toward the limit.
  quiet = scoring.Scorer(QA(), [("flaky", flaky)], max_failed_batches=1)
  quiet.score(rows("1"), ["a"], record=False)


def test_reward_specs_that_do_not_load_are_one_line():
  bad = {
      "nope": "'nope' is not a built-in reward",
      f"{DATA}/missing.py:fn": "no such file",
      f"{TRL_REWARDS}:absent": "has no 'absent'",
      f"{TRL_REWARDS}:NOT_A_FUNCTION": "NOT_A_FUNCTION is a int, not a function",
      "grpo_jax.no_such_module:fn": "importing grpo_jax.no_such_module raised "
                                    "ModuleNotFoundError",
      "a:b:c-d": "expected 'pkg.module:fn'",
  }
  for spec, message in bad.items():
    with pytest.raises(rewards.RewardSpecError, match=message):
      rewards.load(spec)
  name, fn = rewards.load("grpo_jax.tasks.countdown:score")  # a module path
  assert (name, fn) == ("score", countdown.score)


def test_config_checks_name_the_field(tmp_path):
  raising = tmp_path / "raises_on_import.py"
  raising.write_text("raise ImportError('needs a GPU grader')\n")
  cases = [
      (dict(rewards=f"{raising}:fn"), "config.task.rewards: .*raised ImportError: needs a GPU"),
      (dict(rewards="math,format", reward_weights="1"), "config.task.reward_weights: .*need 2"),
      (dict(rewards="math", reward_weights="one"), "not comma-separated numbers"),
      (dict(rewards="math", success_reward="format"), "config.task.success_reward"),
      (dict(success_reward="math"), "need task.rewards"),
      (dict(math_timeout_s=0.0), "config.task.math_timeout_s"),
      (dict(schema="csv"), "config.task.schema"),
  ]
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  for values, message in cases:
    c = grpo.get_config("smoke")
    c.task.update(values)
    with pytest.raises(errors.ConfigError, match=message):
      configuration.validate(c)


def test_a_function_needing_a_column_the_rows_lack_is_refused_before_training():
  _, boxed = rewards.load(f"{TRL_REWARDS}:boxed_matches")  # needs ground_truth

  class NoColumns(QA):
    def reward_inputs(self, problems):
      return [p for p, _ in problems], {"solution": ["2"] * len(problems)}

  scorer = scoring.Scorer(NoColumns(), [("boxed_matches", boxed)])
  with pytest.raises(errors.ConfigError, match="reward 'boxed_matches' needs 'ground_truth', "
                     "but the rows have the columns solution"):
    scorer.check_columns({"solution": ["2"]})


def test_a_builtin_on_rows_without_its_columns_is_refused():
  """countdown reads nums and target; a question / answer task has neither."""
  scorer = scoring.Scorer(QA(), [("countdown", rewards.get("countdown"))])
  with pytest.raises(errors.ConfigError, match="the countdown reward reads the column\\(s\\) "
                     "'nums', 'target', which the qa task's rows do not have"):
    scorer.check_columns({"ground_truth": ["2"]})


def test_evaluation_counts_stay_out_of_the_step_metrics():
  """A built-in's counts (math's unparseable answers) from an evaluation batch (record=False)
  are dropped, not added to the next training batch's."""

  class Counting:
    def __init__(self):
      self.pending = 0

    def __call__(self, completions, **kw):
      self.pending += len(completions)
      return [0.0] * len(completions)

    def take_counts(self):
      counts, self.pending = {"unparseable": self.pending}, 0
      return counts

  scorer = scoring.Scorer(QA(), [("counting", Counting())])
  scorer.score(rows("1", "1", "1"), ["a", "b", "c"], record=False)  # evaluation: 3 answers
  scorer.score(rows("1"), ["a"])  # training: 1 answer
  assert scorer.take_stats()["reward/unparseable"] == 1.0


def _trl_scorer(*names):
  return scoring.Scorer(QA(), [rewards.load(f"{TRL_REWARDS}:{n}") for n in names])


def test_trl_keywords_trainer_state_log_metric_log_extra_and_coroutines():
  """TRL's contract: every function gets ``trainer_state``, ``log_extra`` and ``log_metric``;
  ``async def`` functions are awaited. Functions in TRL's documented forms (data/trl_rewards.py)
  after 1 of 4 steps, on rows (ground truth 2, \\boxed{2}, 4 tokens) and (3, no box, 2 tokens):
    curriculum_length_penalty  -0.01 x 4 x 1/4 = -0.01     -0.01 x 2 x 1/4 = -0.005
    step_from_kwargs           1.0 (global_step)           1.0
    boxed_with_logs            1.0                         0.0    (logs accuracy 1/2)
    async_boxed                1.0                         0.0
  scores (weights 1): 2.99 and 0.995."""
  scorer = _trl_scorer("curriculum_length_penalty", "step_from_kwargs", "boxed_with_logs",
                       "async_boxed")
  scorer.check_columns({"ground_truth": ["2"]})  # trainer_state is TRL's, not a missing column
  scorer.state.global_step, scorer.state.max_steps = 1, 4
  scores, _, failed = scorer.score(rows("2", "3"), ["\\boxed{2}", "no box"],
                                   completion_ids=[[1, 2, 3, 4], [1, 2]])
  np.testing.assert_allclose(scores, [2.99, 0.995], rtol=1e-6)
  assert not failed.any()
  stats = scorer.take_stats()
  assert stats["reward/accuracy"] == 0.5  # log_metric, averaged over the step's one call
  assert [stats[f"reward/{n}_failures"] for n in ("step_from_kwargs", "async_boxed")] == [0, 0]
  metrics, table = scorer.take_log(training=True)
  assert metrics == {}  # training's metrics are take_stats'
  assert [(r["prompt"], r["completion"], r["golden_answer"], r["extracted_answer"],
           r["boxed_with_logs"], r["async_boxed"]) for r in table] == [
               ("q0", "\\boxed{2}", "2", "2", 1.0, 1.0), ("q1", "no box", "3", "[none]", 0.0, 0.0)]
  assert scorer.take_log(training=True) == ({}, [])  # taken
  # Evaluation (record=False): its metrics and columns are kept apart from the step's.
  scorer.state.global_step = 4
  scorer.score(rows("2"), ["\\boxed{1}"], completion_ids=[[5]], record=False)
  assert "reward/accuracy" not in scorer.take_stats()
  metrics, table = scorer.take_log(training=False)
  assert metrics == {"accuracy": 0.0}
  assert table[0]["step_from_kwargs"] == 4.0 and table[0]["curriculum_length_penalty"] == -0.01


def test_coroutines_are_awaited_inside_a_running_event_loop_and_their_errors_counted(capsys):
  """A notebook runs an event loop in the main thread, where asyncio.run may not be called:
  the coroutines then run in a loop of their own in a helper thread. One that raises is that
  function's failure, like a raising function."""

  async def broken(completions, **kw):
    raise ValueError("grader offline")

  scorer = scoring.Scorer(QA(), [rewards.load(f"{TRL_REWARDS}:async_boxed"), ("broken", broken)])

  async def in_a_notebook():
    return scorer.score(rows("1", "1"), ["\\boxed{1}", "1"])

  import asyncio  # pylint: disable=g-import-not-at-top
  scores, _, failed = asyncio.run(in_a_notebook())
  np.testing.assert_array_equal(scores, [1.0, 0.0])
  assert failed.all()
  assert "reward 'broken' raised ValueError: grader offline" in capsys.readouterr().out
  assert scorer.take_stats()["reward/broken_failures"] == 1.0


def test_batches_on_which_every_reward_returns_none_stop_the_run(capsys):
  """No function gives any row a value (None everywhere: nothing to train on) on 3 batches in
  a row: the run stops as for raising functions. A function that returns None for some rows
  (TRL's multi-task form) does not count; evaluation never counts."""
  nothing = lambda completions, **kw: [None] * len(completions)
  some = lambda completions, **kw: [None] * (len(completions) - 1) + [0.0]
  partial = scoring.Scorer(QA(), [("nothing", nothing), ("some", some)], max_failed_batches=3)
  for _ in range(4):
    partial.score(rows("1", "1"), ["a", "b"])
  assert partial.failed_in_a_row == 0
  scorer = scoring.Scorer(QA(), [("nothing", nothing)], max_failed_batches=3)
  for _ in range(3):
    scorer.score(rows("1"), ["a"], record=False)
  scorer.score(rows("1", "1"), ["a", "b"])
  assert "no reward function gave a value for any row" in capsys.readouterr().out
  scorer.score(rows("1", "1"), ["a", "b"])
  with pytest.raises(scoring.RewardError, match=r"every reward function failed or returned None "
                     r"for every row on 3 batches in a row \(last: nothing: None for all 2 rows\)"):
    scorer.score(rows("1", "1"), ["a", "b"])
  assert scorer.take_stats()["reward/valueless_batches"] == 3.0
