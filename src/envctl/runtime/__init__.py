"""Running programs inside an environment: the one entry path (`launch`), what it reads of an
environment that is up (`context`), `envctl exec` (`exec`), and the job system built on them.

Nothing here imports the spec models or the planner: an environment that is up is described
by its journal (see `context.EnvContext.load`), so entering one stays fast.
"""
