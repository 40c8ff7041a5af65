"""The project's one base class for failures a user can act on.

It lives in the lowest layer (reward_fns <- grpo <- tasks <- flows) so that every layer's own
errors can derive from it; the CLI prints any UserError as one line (no traceback unless
--debug), and lets everything else, a bug, show its traceback.
"""


class UserError(Exception):
    """Bad input, a missing file, an unreachable service, a failed stage: the message names
    what and where, in one line."""
