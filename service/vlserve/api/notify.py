"""sd_notify(3) without libsystemd: READY=1 after warm-up, STATUS= lines while loading.

Under a Type=notify unit, `systemctl start` returns only once the worker can answer; elsewhere
(no $NOTIFY_SOCKET) these calls do nothing.
"""

from __future__ import annotations

import os
import socket


def send(message: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        return False
    return True


def status(text: str) -> bool:
    return send("STATUS=%s" % text.replace("\n", " "))


def ready(text: str) -> bool:
    return send("READY=1\nSTATUS=%s" % text.replace("\n", " "))
