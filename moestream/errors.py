"""User-facing errors. The CLI prints these as one line and exits non-zero; anything else is a bug."""


class MoestreamError(Exception):
    """A problem with the user's input or environment, with a message that names it."""


class UnknownNameError(MoestreamError, KeyError):
    """A registry was asked for a name it does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


class BudgetError(MoestreamError):
    """A memory budget that cannot serve the model."""


class CheckpointError(MoestreamError):
    """A checkpoint that is missing, truncated, corrupt or of an unsupported family."""


class TraceError(MoestreamError):
    """A routing trace that is malformed or disagrees with its topology."""
