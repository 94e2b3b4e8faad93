"""The error every config check raises (a leaf module, so any package can raise it)."""


class ConfigError(ValueError):
  """An invalid config value; the message names the field (``config.<group>.<key>: ...``)."""


def check(ok: bool, field: str, message: str) -> None:
  """Raises ConfigError(``config.<field>: <message>``) unless ``ok``."""
  if not ok:
    raise ConfigError(f"config.{field}: {message}")
