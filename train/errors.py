"""User-facing errors and the exit statuses of the command-line programs."""

# Exit statuses: a user error (config, files, environment) is 2; a run stopped by SIGTERM/SIGINT
# after saving what it had done is EXIT_PREEMPTED (sysexits' EX_TEMPFAIL: "try again later"),
# which a scheduler can requeue on.
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75
# A process of a multi-process run whose peer process was lost (stopped, or its host unreachable):
# sysexits' EX_UNAVAILABLE, "a service is unavailable"; every process restarts with --resume.
EXIT_PEER_LOST = 69


class UserError(Exception):
    """A problem with the user's config, files or environment (not a bug)."""
