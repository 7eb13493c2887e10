"""After the page: the policy that picks a response to a hang (``policy``) and what carries it out off the
job's own processes (``drain``: the scheduler; ``hook``: the user's command)."""
