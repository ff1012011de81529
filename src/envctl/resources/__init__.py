"""Resource kinds, one module per kernel object; importing the package registers them all."""

import envctl.resources.bridge  # noqa: F401
import envctl.resources.cgroup_systemd  # noqa: F401
import envctl.resources.firewall  # noqa: F401
import envctl.resources.veth  # noqa: F401
from envctl.resources import cgroup, dirs, governor, kmod, netns, sysctl  # noqa: F401
