"""The one exception type for tokenizer configuration problems, so callers can catch it apart."""


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given arguments (bad type, missing or unreadable file)."""
