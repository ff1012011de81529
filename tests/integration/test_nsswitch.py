"""Entering another network namespace and coming back, on the real kernel: a signal that comes
while a thread is away is delivered at home; and a veth peer born with the address asked for.

Each case runs in a child Python inside the sandbox, so a thread left in the wrong namespace
(the failure this guards against) can never be the test runner's."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.root

# The child: make a namespace, then switch into it with the function under test, which is made
# to send the process `signal` at the moment this thread is away (after setns into the target,
# or after unshare). Prints what happened and where the thread was left.
SWITCH = r'''
import json, os, signal, sys
from pathlib import Path
from envctl.host import netlink, netns

which, sig = sys.argv[1], getattr(signal, sys.argv[2])


class Stop(Exception):
    """What a SIGTERM handler of envctl's kind raises."""


def stop(signum, frame):
    raise Stop(signum)


signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else stop)
stopped = KeyboardInterrupt if sig == signal.SIGINT else Stop
home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
start = os.fstat(home).st_ino
seen = {}


def here():
    return os.stat("/proc/thread-self/ns/net").st_ino


def interrupt_when_away():
    seen["away"] = here() != start
    os.kill(os.getpid(), sig)


spaces = netns.NetNamespaces(Path("/run/netns"))
if which == "socket_in":
    spaces.create("t-sig")
    real_setns, calls = netlink._setns, []

    def setns(fd):
        real_setns(fd)
        calls.append(fd)
        if len(calls) == 1:
            interrupt_when_away()

    netlink._setns = setns
    call = lambda: netlink.socket_in(Path("/run/netns/t-sig")).close()
else:
    Path("/run/netns").mkdir(exist_ok=True)
    Path("/run/netns/t-sig").touch()
    real_check = netns._check

    def check(ret, what):
        real_check(ret, what)
        if what == "unshare":
            interrupt_when_away()

    netns._check = check
    call = lambda: netns._bind_new_namespace("/run/netns/t-sig")
try:
    call()
    result = "returned"
except stopped:
    result = "interrupted"
left_home = here() != start
if left_home:  # back, so that the clean-up acts on the sandbox's namespace
    assert netlink._libc.setns(home, netlink.CLONE_NEWNET) == 0
spaces.remove("t-sig")
print(json.dumps({"result": result, "away": seen.get("away"), "left_home": left_home}))
'''


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("which", ["socket_in", "bind_new_namespace"])
def test_a_signal_while_away_is_delivered_at_home(clean, which, signame):
    res = clean.run(sys.executable, "-c", SWITCH, which, signame, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["away"] is True, "the signal was not sent from the other namespace"
    assert out["result"] == "interrupted"  # the signal still arrives, once back
    assert out["left_home"] is False


PEER_ADDRESS = r'''
import json
from pathlib import Path
from envctl.host.netlink import Netlink
from envctl.host.netns import NetNamespaces

spaces = NetNamespaces(Path("/run/netns"))
spaces.create("t-mac")
nl = Netlink(Path("/run/netns"))
try:
    nl.add_veth("t-v0", peer="eth0", peer_netns="t-mac", peer_address="02:ab:cd:ef:01:23")
    out = {"peer": nl.link("eth0", netns="t-mac").address, "host": nl.link("t-v0").address}
    nl.delete_link("t-v0")
finally:
    nl.close()
    spaces.remove("t-mac")
print(json.dumps(out))
'''


def test_veth_peer_is_born_with_the_address_asked_for(clean):
    res = clean.run(sys.executable, "-c", PEER_ADDRESS, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["peer"] == "02:ab:cd:ef:01:23"
    assert out["host"] != out["peer"] and len(out["host"].split(":")) == 6
