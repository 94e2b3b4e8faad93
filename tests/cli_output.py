"""What a quiet command must not print: the INFO lines of orbax, absl and JAX (shared by the
tests of the train and benchmark commands)."""

import re

THIRD_PARTY_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d|^INFO:|Unable to initialize backend|"
                             r"CheckpointManagerOptions", re.M)
