"""Writes the small own-task files of tests/data (run from the repo root; deterministic).

* ``verl_math_train.parquet`` / ``verl_math_test.parquet``: rows in verl's RL format, as its
  MATH / GSM8K preprocessing writes them (prompt messages, reward_model.ground_truth,
  data_source, ability, extra_info).
"""

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."


def verl_row(question: str, answer: str, index: int, split: str) -> dict:
  return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
          "prompt": [{"role": "user", "content": question + SUFFIX}], "ability": "math",
          "reward_model": {"style": "rule", "ground_truth": answer},
          "extra_info": {"split": split, "index": index}}


TRAIN = [("What is 1/2 + 1/4?", "\\frac{3}{4}"), ("Solve x + 2 = 7.", "5"),
         ("What is sqrt(8)?", "2\\sqrt{2}"), ("What is 3 * 4?", "12"),
         ("Which x satisfy 1 < x <= 2?", "(1, 2]"), ("What is 10 - 3?", "7")]
TEST = [("What is 2 + 2?", "4"), ("What is 10/4?", "\\frac{5}{2}")]

if __name__ == "__main__":
  for name, rows in (("train", TRAIN), ("test", TEST)):
    table = pa.Table.from_pylist([verl_row(q, a, i, name) for i, (q, a) in enumerate(rows)])
    pq.write_table(table, f"tests/data/verl_math_{name}.parquet")
