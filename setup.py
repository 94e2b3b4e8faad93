"""grpo_jax: sample-efficient RL post-training of language models in JAX."""

import setuptools

setuptools.setup(
    name="grpo_jax",
    version="0.1.0",
    description=("GRPO and rollout-efficient replay / allocation methods (POPO, prioritised "
                 "replay, Headroom-Drift, SARA) for RLVR in JAX/Flax NNX."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["grpo_jax", "grpo_jax.*"]),
    package_data={"grpo_jax": ["assets/*/*"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.6",
        "flax>=0.12",
        "optax",
        "orbax-checkpoint",
        "chex",
        "ml-collections",
        "transformers>=4.51",
        "tensorflow-datasets",
        "safetensors>=0.4",
        "tokenizers",
        "numpy",
        "absl-py",
        "tqdm",
        # TensorBoard event files without TensorFlow (pure Python: protobuf + numpy).
        "tensorboardX",
        # Math answers (grpo_jax/rewards/math_answers.py), pinned: its parsing decides the rewards.
        "math-verify==0.9.0",
        # Parquet data files (verl's format; grpo_jax/tasks/data_files.py).
        "pyarrow",
        # The run's report plots (grpo_jax/run/report_writer.py): part of what a run writes.
        "matplotlib",
    ],
    extras_require={
        # pytest-xdist: the suite runs on two workers (pyproject.toml's addopts;
        # tests/conftest.py caps the worker count).
        "test": ["pytest", "pytest-xdist>=3.5", "hypothesis"],
        # TFDS needs TensorFlow to build or mock datasets (GSM8K); CI installs it. The CPU
        # build: TensorFlow only reads the data here, and its CUDA build would claim the GPU.
        "tfds": ["tensorflow-cpu"],
        # Accelerators: JAX with its matching CUDA plugin or libtpu, pinned together by JAX's
        # own extras (installed separately, a later upgrade of jax could leave the plugin
        # behind, and JAX then falls back to the CPU). docs/scaling.md: Accelerators.
        "cuda12": ["jax[cuda12]"],
        "cuda13": ["jax[cuda13]"],
        "tpu": ["jax[tpu]"],
        # Kept for old install commands: matplotlib is now a dependency of the package.
        "bench": [],
    },
)
