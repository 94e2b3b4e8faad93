"""The error every config check raises (a leaf module, so any package can raise it)."""


class ConfigError(ValueError):
  """An invalid config value; the message names the field (``config.<group>.<key>: ...``)."""
