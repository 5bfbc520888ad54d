"""The one base class of errors whose message is meant for the user: the CLI prints it, no traceback."""


class MegadiffError(Exception):
    """A config, data, checkpoint or conversion that cannot work, explained in the message."""
