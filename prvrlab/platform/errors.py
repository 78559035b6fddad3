"""The configuration error every layer of the platform raises (a leaf module: it imports nothing, so
the config, storage and tracking modules can all raise it without importing each other)."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending key."""


ConfigError.__module__ = "prvrlab.platform.config"  # its public home: tracebacks and pickles name it there
