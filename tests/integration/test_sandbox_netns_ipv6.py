"""configs/sandbox-netns.sh filters IPv4 only (iptables), so it must leave the sandbox no IPv6:
with IPv6 on, both veth ends get fe80:: addresses and the sandbox could reach any host service
bound to [::] around the rules. Needs root (as test_transparent.py); skipped otherwise. Only the
test's own namespace is touched; no traffic is sent."""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from test_transparent import Sandbox, require_netns
from upstream import free_port


def _ipv6_addresses(*prefix: str) -> str:
    r = subprocess.run([*prefix, "ip", "-6", "-o", "addr", "show"], capture_output=True,
                       text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_sandbox_and_its_veth_pair_have_no_ipv6():
    require_netns()
    if not os.path.isdir("/proc/sys/net/ipv6"):
        pytest.skip("this kernel has no IPv6")
    name = f"eg6{uuid.uuid4().hex[:4]}"
    sb = Sandbox(name, "10.250.36.0", free_port(), [443], [])
    try:
        host_if, ns_if = f"v{name}h", f"v{name}s"
        with open(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6") as f:
            assert f.read().strip() == "1"
        assert host_if not in _ipv6_addresses()  # no fe80:: on the host end
        inside = _ipv6_addresses("ip", "netns", "exec", name)
        assert inside.strip() == "", f"IPv6 addresses inside the sandbox: {inside}"
        r = subprocess.run(["ip", "netns", "exec", name, "sysctl", "-n",
                            f"net.ipv6.conf.{ns_if}.disable_ipv6",
                            "net.ipv6.conf.default.disable_ipv6"],
                           capture_output=True, text=True, timeout=10)
        assert r.stdout.split() == ["1", "1"], r.stdout + r.stderr
    finally:
        sb.down()
