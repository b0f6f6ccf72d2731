"""The one exception type for bad data inputs, so a user sees which file is wrong and how to fix it."""


class DataError(ValueError):
    """A data file or data option is missing, corrupt or inconsistent; the message names it and the fix."""
