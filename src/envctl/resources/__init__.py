"""Resource kinds, one module per kernel object; importing the package registers them all."""

from envctl.resources import dirs, netns, sysctl  # noqa: F401
