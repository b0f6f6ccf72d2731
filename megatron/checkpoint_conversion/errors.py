"""The one error type of checkpoint conversion, so the command-line tools can print it and exit 2."""


class ConversionError(ValueError):
    """A checkpoint or configuration that cannot be converted; the message names the file or option and
    what to do about it."""
