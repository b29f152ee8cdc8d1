#!/usr/bin/env python3
"""A stand-in for a KMS plugin, for keys.kms_command in tests (there is no KMS on loopback).

    kms_stub.py KEYFILE key-id | wrap | unwrap

`wrap` reads base64 on stdin and prints base64 of nonce || ciphertext || tag: the input XORed
with a SHA-256 keystream of KEYFILE's bytes and an HMAC-SHA-256 tag (standard library only).
Not a cipher to use anywhere else; enough that a wrong key fails and that no data key reaches
etcd in the clear. `unwrap` reverses it; `key-id` prints the key's fingerprint, or the text
of KEYFILE.id when that file exists (a KMS whose key version moved on: a new key id, and it
still unwraps what it wrapped before, as Kubernetes KMS v2 plugins do). While KEYFILE.down
exists, `wrap` and `unwrap` fail (a KMS that is down). Each wrap or unwrap asked is appended to
KEYFILE.calls (its verb on a line).
"""
import base64
import hashlib
import hmac
import os
import sys


def stream(key: bytes, nonce: bytes, n: int) -> bytes:
    out = b""
    i = 0
    while len(out) < n:
        out += hashlib.sha256(key + nonce + i.to_bytes(4, "big")).digest()
        i += 1
    return out[:n]


def main() -> int:
    with open(sys.argv[1], "rb") as f:
        key = f.read()
    verb = sys.argv[2]
    if verb == "key-id":
        if os.path.exists(sys.argv[1] + ".id"):
            with open(sys.argv[1] + ".id") as f:
                print(f.read().strip())
        else:
            print(hashlib.sha256(key).hexdigest()[:16])
        return 0
    data = base64.b64decode(sys.stdin.read().strip())
    with open(sys.argv[1] + ".calls", "a") as f:  # one line per wrap or unwrap asked
        f.write(verb + "\n")
    if os.path.exists(sys.argv[1] + ".down"):
        print("kms_stub: unavailable", file=sys.stderr)
        return 1
    if verb == "wrap":
        nonce = os.urandom(16)
        ct = bytes(a ^ b for a, b in zip(data, stream(key, nonce, len(data))))
        tag = hmac.new(key, nonce + ct, hashlib.sha256).digest()
        sys.stdout.write(base64.b64encode(nonce + ct + tag).decode())
        return 0
    if verb == "unwrap":
        nonce, ct, tag = data[:16], data[16:-32], data[-32:]
        if not hmac.compare_digest(tag, hmac.new(key, nonce + ct, hashlib.sha256).digest()):
            print("kms_stub: wrong key", file=sys.stderr)
            return 1
        sys.stdout.write(base64.b64encode(
            bytes(a ^ b for a, b in zip(ct, stream(key, nonce, len(ct))))).decode())
        return 0
    print(f"kms_stub: unknown verb {verb!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
