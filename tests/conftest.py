"""Shared fixtures: tiny models built once per session."""

import os
import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
  return DATA


@pytest.fixture(scope="session")
def tiny_qwen3():
  from grpo_jax.models import from_pretrained
  return from_pretrained(os.fspath(DATA / "tiny_qwen3"))


@pytest.fixture(scope="module")
def split(tiny_qwen3):
  """(graphdef, params) of the tiny Qwen3; per module, so a module may donate its params."""
  from flax import nnx
  return nnx.split(tiny_qwen3)


@pytest.fixture(scope="session")
def tiny_qwen2():
  from grpo_jax.models import from_pretrained
  return from_pretrained(os.fspath(DATA / "tiny_qwen2"))


@pytest.fixture(scope="session")
def golden():
  import numpy as np
  return dict(np.load(DATA / "golden_logits.npz"))
