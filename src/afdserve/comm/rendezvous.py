"""Rendezvous through the launcher's key-value store (a torch.distributed Store, e.g. TCPStore).

Each Communicator publishes one endpoint (TCP address, machine id, pid) under
``afd_comm/<group>/ep/<name>``; a sender looks up its receivers' endpoints and dials them. Everything
else (transport choice, segment names, slot geometry) is negotiated on the pair's own socket with
small length-prefixed JSON frames: only at connect time, never on the data path.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import socket
import struct
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from afdserve.comm.errors import ConnectError

_LEN = struct.Struct("<I")
_now = time.monotonic


@dataclass(frozen=True)
class Endpoint:
    name: str
    host: str
    port: int
    machine: str
    arch: str
    pid: int


def machine_id() -> str:
    """Hostname + kernel boot id: equal iff two processes run on the same (booted) machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def advertise_host(store: dist.Store, configured: str | None) -> str:
    """The address peers should dial: configured, $AFD_COMM_HOST, or the interface reaching the store."""
    if configured:
        return configured
    env = os.environ.get("AFD_COMM_HOST")
    if env:
        return env
    while hasattr(store, "underlying_store"):  # PrefixStore(...) around a TCPStore
        store = store.underlying_store
    store_host = getattr(store, "host", None)
    if store_host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(store_host), int(getattr(store, "port", 1) or 1)))
                return s.getsockname()[0]
        except OSError:
            pass
    return "127.0.0.1"


def endpoint_key(group: str, name: str) -> str:
    return f"afd_comm/{group}/ep/{name}"


def publish(store: dist.Store, group: str, ep: Endpoint) -> None:
    store.set(endpoint_key(group, ep.name), json.dumps(asdict(ep)))


def lookup(store: dist.Store, group: str, name: str, deadline: float) -> Endpoint:
    key = endpoint_key(group, name)
    rem = deadline - _now()
    try:
        store.wait([key], datetime.timedelta(seconds=max(rem, 0.001)))
        raw = store.get(key)
    except Exception as e:  # the store raises RuntimeError / DistStoreError on timeout
        raise ConnectError(f"peer {name!r} did not publish its endpoint ({key}) in time: {e}") from e
    return Endpoint(**json.loads(raw.decode() if isinstance(raw, bytes) else raw))


def dial(store: dist.Store, group: str, name: str, deadline: float) -> socket.socket:
    """Connect to peer ``name``; retries (re-reading its endpoint) until the deadline."""
    last: Exception | None = None
    while _now() < deadline:
        ep = lookup(store, group, name, deadline)
        try:
            sock = socket.create_connection((ep.host, ep.port), timeout=max(0.05, min(5.0, deadline - _now())))
            configure(sock)
            return sock
        except OSError as e:
            last = e
            if e.errno not in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, None):
                break
            time.sleep(0.02)
    raise ConnectError(f"could not connect to peer {name!r}: {last}")


def configure(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def listener(advertised: str) -> socket.socket:
    loopback = advertised.startswith("127.") or advertised == "localhost"
    return socket.create_server(("127.0.0.1" if loopback else "", 0), backlog=1024)


def this_endpoint(name: str, host: str, port: int, machine: str | None = None) -> Endpoint:
    return Endpoint(name, host, port, machine or machine_id(), platform.machine(), os.getpid())


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, deadline: float, peer: str) -> dict:
    def read(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            rem = deadline - _now()
            if rem <= 0:
                raise ConnectError(f"peer {peer!r} did not complete the handshake in time")
            sock.settimeout(rem)
            try:
                chunk = sock.recv(n - len(out))
            except socket.timeout:
                continue
            except OSError as e:
                raise ConnectError(f"peer {peer!r} dropped the connection during the handshake: {e}") from e
            if not chunk:
                raise ConnectError(f"peer {peer!r} closed the connection during the handshake")
            out += chunk
        return bytes(out)

    (n,) = _LEN.unpack(read(_LEN.size))
    if n > 1 << 20:
        raise ConnectError(f"peer {peer!r} sent a malformed handshake frame")
    return json.loads(read(n))
