"""The one error type a user sees for bad input: it names the field, file or key and what was expected."""


class ConfigError(ValueError):
    """Bad input found before any engine starts. `field` is the config key at fault (e.g. `edit.vector.key`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
