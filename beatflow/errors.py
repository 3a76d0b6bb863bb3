"""Errors a user sees: one line, naming the file and the problem."""


class BeatflowError(Exception):
    """Base class of the errors the CLI reports as one clear line (no traceback)."""


class InputError(BeatflowError):
    """The input cannot be used: missing, empty, malformed, non-finite, too short, no beats."""


class DeviceError(BeatflowError):
    """The requested device (GPU) or its libraries are not available."""
