"""Errors that the scripts turn into one line on stderr and exit code 2.

Library code raises these for anything the user can fix (a config key, a file, a data row);
`scripts/*.py` catch `UserError` and print `error: <message>` without a traceback.
"""


class UserError(Exception):
    """Base class: bad input from the user. The message is one line and names the culprit."""


class ConfigError(UserError, ValueError):
    """A config key is unknown, mistyped, out of range, or the batch arithmetic is impossible."""


class DataError(UserError):
    """A data file is missing or malformed, or a row cannot be used (names file and row)."""


class ModelError(UserError):
    """A model or tokenizer directory is missing a file or has an unsupported config."""
