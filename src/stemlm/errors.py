"""The one exception type stemlm raises for problems a user can fix (bad config, bad data, bad checkpoint).

The CLI turns a `StemlmError` (and the ValueError / OSError families) into one line on stderr and a
non-zero exit; everything else is a bug and keeps its traceback under `--debug`.
"""


class StemlmError(ValueError):
    """A user-facing error: the message names the problem and, where possible, the fix."""
