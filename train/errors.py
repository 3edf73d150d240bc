"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class UserError(Exception):
    """A problem with the user's config, files or environment (not a bug)."""
