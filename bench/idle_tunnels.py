#!/usr/bin/env python3
"""Memory per idle CONNECT tunnel: opens N blind tunnels through egressd to a loopback TCP
server that accepts and holds, and reports egressd's RSS growth per tunnel (issue 5 target:
10 000 idle tunnels under 64 KiB each) and its idle RSS (target: under 20 MiB).

    bench/idle_tunnels.py [BUILD_DIR] [N] [--intercept]     (default: build 10000)

--intercept: the run intercepts instead (`unpinned: intercept`): each client completes a TLS
handshake with the run CA through its tunnel and then idles, so egressd holds a TLS connection
per tunnel (whose record buffers it frees after TlsSocket::kIdleRelease without use; RSS is
read 3 s after the last handshake).

Everything on 127.0.0.1; raises RLIMIT_NOFILE to 2*N + 100 for egressd (two descriptors per
tunnel) within the hard limit."""
from __future__ import annotations

import base64
import os
import ssl
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time


HOLDER = """
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(4096)
print(s.getsockname()[1], flush=True)
held = []
while True:
    held.append(s.accept()[0])
"""


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--intercept"]
    intercept = "--intercept" in sys.argv[1:]
    build = args[0] if args else "build"
    n = int(args[1]) if len(args) > 1 else 10000
    need = n + 200
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * n + 100:
        print(f"RLIMIT_NOFILE hard limit {hard}: egressd needs {2 * n + 100} for {n} tunnels; "
              f"lower N (at most {(hard - 100) // 2})", file=sys.stderr)
        return 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (2 * n + 100, hard))  # egressd inherits it

    # The holding server is its own process: each side then needs only N descriptors.
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(need)], stdout=subprocess.PIPE,
                              text=True)
    hold_port = int(holder.stdout.readline())

    w = tempfile.mkdtemp(prefix="egress-idle-")
    px, ad = free_port(), free_port()
    with open(f"{w}/run.token", "w") as f:
        f.write("idletoken")
    with open(f"{w}/egressd.yaml", "w") as f:
        f.write(f"""listen: {{proxy: 127.0.0.1:{px}, admin: 127.0.0.1:{ad}}}
admin: {{token_file: {w}/admin.token}}
state: {{path: {w}/state}}
keys: {{master_key_file: {w}/master.key}}
resolver: {{overrides: {{hold.test: [127.0.0.1]}}}}
policy: {{unpinned: {"intercept" if intercept else "tunnel"}, allow_hosts: [hold.test], allow_networks: [127.0.0.1/32],
          allowed_ports: [{hold_port}]}}
limits: {{connections_per_run: {n + 100}, idle_timeout: 10m}}
audit: {{path: {w}/audit.jsonl}}
log: {{level: warn}}
runs:
  - {{id: idle, token_file: {w}/run.token, ca_cert_out: {w}/ca.pem}}
""")
    eg = subprocess.Popen([os.path.join(build, "egressd"), "--config", f"{w}/egressd.yaml"],
                          stderr=open(f"{w}/egressd.log", "wb"))
    auth = base64.b64encode(b"idle:idletoken").decode()
    conns: list[socket.socket] = []
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", ad), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)

        def open_tunnel() -> socket.socket:
            s = socket.create_connection(("127.0.0.1", px), timeout=10)
            s.sendall(f"CONNECT hold.test:{hold_port} HTTP/1.1\r\nHost: hold.test:{hold_port}\r\n"
                      f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    raise RuntimeError("tunnel closed: " + got.decode(errors="replace"))
                got += chunk
            if not got.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(got.decode(errors="replace"))
            if intercept:
                t = tls.wrap_socket(s, server_hostname="hold.test")  # handshake with egressd
                return t
            return s

        if intercept:
            tls = ssl.create_default_context(cafile=f"{w}/ca.pem")
        for _ in range(10):  # warm: allocator arenas, first-use paths
            conns.append(open_tunnel())
        time.sleep(0.5)
        idle = rss_kib(eg.pid)
        t0 = time.monotonic()
        for _ in range(n):
            conns.append(open_tunnel())
        took = time.monotonic() - t0
        time.sleep(3.0 if intercept else 1.0)
        after = rss_kib(eg.pid)
        hwm = rss_kib(eg.pid, "VmHWM")
        per = (after - idle) * 1024 / n
        print(f"egressd idle RSS (10 tunnels open): {idle / 1024:.1f} MiB")
        kind = "intercepted TLS" if intercept else "CONNECT"
        print(f"{n} idle {kind} tunnels opened in {took:.1f} s; RSS {after / 1024:.1f} MiB, "
              f"peak {hwm / 1024:.1f} MiB")
        print(f"per idle tunnel: {per / 1024:.1f} KiB (target < 64 KiB)")
        ok = per < 64 * 1024
    finally:
        for s in conns:
            s.close()
        eg.terminate()
        try:
            eg.wait(timeout=20)
        except subprocess.TimeoutExpired:
            eg.kill()
        holder.kill()
        shutil.rmtree(w, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
