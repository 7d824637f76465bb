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


class Interrupted(UserError):
    """SIGTERM (or SIGINT) stopped the run; the same command resumes it from its newest
    complete checkpoint."""


def one_line(exc: BaseException) -> str:
    """What the scripts print after `error: ` for `exc`, on one line.

    A `UserError` is its message; an `OSError` names the file and the system's reason (a
    full disk, a read-only or missing directory); anything else is a bug, told in one line
    with the path of a file holding its traceback.
    """
    if isinstance(exc, UserError):
        text = str(exc)
    elif isinstance(exc, KeyboardInterrupt):
        text = ("interrupted; the newest complete checkpoint is kept, and the same command "
                "resumes from it")
    elif isinstance(exc, OSError) and exc.strerror:
        files = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        text = f"{files}: {exc.strerror}" if files else exc.strerror
    else:
        import tempfile
        import traceback

        fd, path = tempfile.mkstemp(prefix="rlhf_jax-error-", suffix=".txt")
        with open(fd, "w") as f:
            f.write("".join(traceback.format_exception(exc)))
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        text = f"unexpected {type(exc).__name__}: {first} (a bug; traceback in {path})"
    return " ".join(text.split("\n"))
