"""User-facing errors and the exit statuses of the command-line programs."""

# Exit statuses: a user error (config, files, environment) is 2; a run stopped by SIGTERM/SIGINT
# after saving what it had done is EXIT_PREEMPTED (sysexits' EX_TEMPFAIL: "try again later"),
# which a scheduler can requeue on.
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75


class UserError(Exception):
    """A problem with the user's config, files or environment (not a bug)."""
