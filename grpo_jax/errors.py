"""The errors every stage raises with a one-line message (a leaf module, so any package can
raise them): a bad config value and a checkpoint folder that cannot be loaded."""


class ConfigError(ValueError):
  """An invalid config value; the message names the field (``config.<group>.<key>: ...``)."""


def check(ok: bool, field: str, message: str) -> None:
  """Raises ConfigError(``config.<field>: <message>``) unless ``ok``."""
  if not ok:
    raise ConfigError(f"config.{field}: {message}")


class CheckpointError(ValueError):
  """A checkpoint folder that cannot be loaded, with a message naming what is wrong."""
