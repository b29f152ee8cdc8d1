"""Audit file writes that fail (a full disk, an I/O error): each failure is logged and counted
(egressd_audit_write_errors_total), and leaves no torn line: the records that went whole stay,
the part of one after them is cut off, and the records that follow are whole JSON lines.

The disk fills up here without root and without a filesystem of its own: egressd runs under
RLIMIT_FSIZE (with SIGXFSZ ignored, a write past the limit writes what fits and then fails
with EFBIG, as one on a full disk does with ENOSPC), and the test lifts the limit later with
prlimit(2), as an operator frees space."""
from __future__ import annotations

import os
import resource
import sys

import pytest

import helpers
from helpers import poll

LIMIT = 1 << 20  # bytes any file egressd writes may reach; the audit file is filled up to it
ROOM = 100       # left free in the audit file: less than one record

# Runs egressd (argv[2:]) under RLIMIT_FSIZE argv[1], SIGXFSZ ignored (kept across exec).
WRAPPER = ("import os, resource, signal, sys\n"
           "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
           "_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)\n"
           "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), hard))\n"
           "os.execv(sys.argv[2], sys.argv[2:])\n")


def _metric(e, name: str) -> int | None:
    got = e.admin_get("/metrics")
    if got is None or got[0] != 200:
        return None
    for line in got[1].decode().splitlines():
        if line.startswith(name + " "):
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("durable", [False, True], ids=["plain", "durable"])
def test_a_full_disk_is_logged_counted_and_leaves_no_torn_line(world, factory, durable):
    e = factory.make(mutate=lambda c: c["audit"].update(durable=durable))
    filler = b'{"filler":"' + b"f" * 1000 + b'"}\n'
    with open(e.audit_path, "wb") as f:
        size = 0
        while size + len(filler) <= LIMIT - ROOM:
            f.write(filler)
            size += len(filler)
        f.write(b"\n" * (LIMIT - ROOM - size))  # empty lines: room for exactly ROOM bytes
    with open(e.audit_path, "rb") as f:
        original = f.read()
    full = len(original)
    e.binary_prefix = [sys.executable, "-c", WRAPPER, str(LIMIT)]
    factory.started.append(e)
    e.start()

    def deny():
        c, r = helpers.proxy_connect(e.proxy_port, f"unlisted.test:{world.U}", world.auth())
        c.close()
        assert r.status == 403

    def denials():
        with open(e.audit_path, "rb") as f:
            recs = helpers.audit_lines(f.read())  # every line must parse
        return sum(1 for r in recs if r.get("host") == "unlisted.test")

    deny()  # its record does not fit: ROOM bytes of it are written, then the write fails
    poll(lambda: "audit: writing " + e.audit_path + " failed" in e.stderr_text(), 10,
         "the write failure's log line")
    assert _metric(e, "egressd_audit_write_errors_total") >= 1
    assert os.path.getsize(e.audit_path) == full, "the torn part of the record was left"

    # Space again (an operator freed some): the next record is a whole line of its own.
    _, hard = resource.prlimit(e.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(e.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
    deny()
    poll(lambda: denials() == 1, 10, "the record written after the failure")
    poll(lambda: "audit: writing " + e.audit_path + " works again" in e.stderr_text(), 10,
         "the recovery's log line")
    with open(e.audit_path, "rb") as f:
        data = f.read()
    assert data.startswith(original)
    rest = data[full:].splitlines(keepends=True)
    assert len(rest) == 1 and rest[0].endswith(b"}\n"), rest
