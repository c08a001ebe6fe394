"""Connecting a Communicator to its peers: one socket and one registered buffer per directed pair.

Steps (each side knows only its own peers; no step waits on a peer that has nothing to exchange):
 1. listen, publish the endpoint in the store;
 2. for every peer we send to: dial it, send ``hello`` (our transport preference, machine id);
 3. accept one connection per peer we receive from; choose the pair's transport, register the
    slots (create the shared-memory segment), reply ``offer`` with the slot geometry;
 4. on every outgoing socket: read the offer, map the segment (verifying its nonce), reply ``ack``;
 5. on every incoming socket: read the ack, unlink the segment's name (nothing stays in /dev/shm);
 6. torch pairs: build the two-rank process groups in one global order of pairs.
Only 2 waits on 1 and 4 on 3 of the peer, so no cycle of waits can form.
"""

from __future__ import annotations

import os
import platform
import secrets
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from afdserve.comm import rendezvous as rdv
from afdserve.comm.channel import RecvChannel, SendChannel
from afdserve.comm import futex
from afdserve.comm.config import CommConfig
from afdserve.comm.doorbell import Doorbell
from afdserve.comm.errors import ConnectError
from afdserve.comm.shm import Segment
from afdserve.comm.shm_transport import ShmRecvChannel, ShmSendChannel, attach_pair_segment, create_pair_segment
from afdserve.comm.tcp_transport import TcpRecvChannel, TcpSendChannel
from afdserve.comm.torch_transport import TorchRecvChannel, TorchSendChannel, make_group

_now = time.monotonic


@dataclass
class Links:
    send: dict[str, SendChannel] = field(default_factory=dict)
    recv: dict[str, RecvChannel] = field(default_factory=dict)
    bell: Doorbell | None = None  # ours (its name is unlinked once every peer mapped it)
    peer_bells: dict[str, Doorbell] = field(default_factory=dict)

    def close(self) -> None:
        for ch in list(self.send.values()) + list(self.recv.values()):
            try:
                ch.close()
            except Exception:  # closing must never raise (finalizers, error paths)
                pass
        self.send.clear()
        self.recv.clear()
        for b in list(self.peer_bells.values()) + ([self.bell] if self.bell is not None else []):
            b.close()
        self.peer_bells.clear()
        self.bell = None


def preferred_transport(config: CommConfig) -> str:
    if config.transport == "auto":
        env = os.environ.get("AFD_COMM_TRANSPORT", "auto")
        return env if env in ("auto", "shm", "tcp", "torch") else "auto"
    return config.transport


def choose_transport(sender_pref: str, receiver_pref: str, same_machine: bool, peer: str) -> tuple[str, bool]:
    """The pair's transport and whether falling back to tcp is allowed (when shm cannot be mapped)."""
    if "auto" not in (sender_pref, receiver_pref) and sender_pref != receiver_pref:
        raise ConnectError(f"peer {peer!r} wants transport {sender_pref!r}, this side {receiver_pref!r}")
    forced = receiver_pref if receiver_pref != "auto" else sender_pref
    if forced != "auto":
        return forced, False
    return ("shm" if same_machine and platform.machine() in ("x86_64", "AMD64") else "tcp"), True


def _torch_backend(config: CommConfig) -> tuple[str, torch.device]:
    device = torch.device(config.device)
    backend = config.torch_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    return backend, device


def establish(name: str, group: str, store: dist.Store, config: CommConfig, send_to: list[str],
              recv_from: list[str], timeout_s: float) -> Links:
    deadline = _now() + timeout_s
    pref = preferred_transport(config)
    me = config.machine_id or rdv.machine_id()
    lsock = None
    out: dict[str, socket.socket] = {}
    inc: dict[str, socket.socket] = {}
    segments: dict[str, Segment] = {}
    attached: dict[str, Segment] = {}
    links = Links()
    try:
        if futex.AVAILABLE and pref in ("auto", "shm"):
            links.bell = Doorbell.create()
        bell_name = links.bell.name if links.bell is not None else None
        host = rdv.advertise_host(store, config.host)
        lsock = rdv.listener(host)
        rdv.publish(store, group, rdv.this_endpoint(name, host, lsock.getsockname()[1], me))

        # 2. dial our receivers
        for peer in send_to:
            s = rdv.dial(store, group, peer, deadline)
            out[peer] = s
            rdv.send_frame(s, {"op": "hello", "from": name, "to": peer, "group": group, "transport": pref,
                               "machine": me, "bell": bell_name})

        # 3. accept our senders, register their slots, offer
        hellos: dict[str, dict] = {}
        pending = set(recv_from)
        while pending:
            rem = deadline - _now()
            if rem <= 0:
                raise ConnectError(f"{name!r}: peer(s) {sorted(pending)} never connected (group {group!r})")
            lsock.settimeout(rem)
            try:
                conn, _ = lsock.accept()
            except socket.timeout:
                continue
            rdv.configure(conn)
            try:
                hello = rdv.recv_frame(conn, deadline, "?")
            except ConnectError:
                conn.close()
                continue
            src = str(hello.get("from"))
            if hello.get("op") != "hello" or hello.get("to") != name or hello.get("group") != group \
                    or src not in pending:
                rdv.send_frame(conn, {"op": "offer", "error": f"{name!r} in group {group!r} does not expect "
                                                               f"{src!r}"})
                conn.close()
                continue
            pending.discard(src)
            inc[src] = conn
            hellos[src] = hello
        fallback_ok: dict[str, bool] = {}
        choice: dict[str, str] = {}
        my_offers: dict[str, dict] = {}
        for src, conn in inc.items():
            hello = hellos[src]
            try:
                t, fb = choose_transport(str(hello.get("transport")), pref, hello.get("machine") == me, src)
            except ConnectError as e:
                rdv.send_frame(conn, {"op": "offer", "error": str(e)})
                raise
            if t == "shm":  # both ends need the other's doorbell
                why = None
                try:
                    if links.bell is None or not hello.get("bell"):
                        raise ValueError("no futex doorbell on one side")
                    if src not in links.peer_bells:
                        links.peer_bells[src] = Doorbell.attach(str(hello["bell"]))
                except (OSError, ValueError) as e:
                    why = str(e)
                if why is not None:
                    if not fb:
                        rdv.send_frame(conn, {"op": "offer", "error": f"shared memory impossible: {why}"})
                        raise ConnectError(f"shared memory with peer {src!r} impossible: {why}")
                    t = "tcp"
            choice[src], fallback_ok[src] = t, fb
            offer = {"op": "offer", "transport": t, "num_slots": config.num_slots, "slot_bytes": config.slot_bytes,
                     "fallback": fb, "bell": bell_name}
            if t == "shm":
                seg, nonce = create_pair_segment(config.num_slots, config.slot_bytes)
                segments[src] = seg
                offer.update(shm=seg.name, nonce=nonce)
            elif t == "torch":
                backend, _ = _torch_backend(config)
                offer.update(prefix=f"afd_comm/{group}/pg/{src}>{name}/{secrets.token_hex(6)}", backend=backend)
            my_offers[src] = offer
            rdv.send_frame(conn, offer)

        # 4. read our receivers' offers, map their segments, ack
        offers: dict[str, dict] = {}
        for dst, s in out.items():
            offer = rdv.recv_frame(s, deadline, dst)
            if offer.get("error"):
                raise ConnectError(f"peer {dst!r} refused the connection: {offer['error']}")
            ack: dict = {"op": "ack", "ok": True}
            if offer["transport"] == "shm":
                try:
                    attached[dst] = attach_pair_segment(offer["shm"], offer["num_slots"], offer["slot_bytes"],
                                                        offer["nonce"])
                    if dst not in links.peer_bells:
                        links.peer_bells[dst] = Doorbell.attach(str(offer["bell"]))
                except (OSError, ValueError) as e:
                    ack = {"op": "ack", "ok": False, "why": f"cannot map {offer['shm']}: {e}"}
                    if not offer.get("fallback"):
                        rdv.send_frame(s, ack)
                        raise ConnectError(f"shared memory to peer {dst!r} impossible: {ack['why']}") from e
                    offer["transport"] = "tcp"
            offers[dst] = offer
            rdv.send_frame(s, ack)

        # 5. read acks, unlink segment names
        for src, conn in inc.items():
            ack = rdv.recv_frame(conn, deadline, src)
            seg = segments.get(src)
            if seg is not None:
                seg.unlink()
            if not ack.get("ok"):
                if choice[src] == "shm" and fallback_ok[src]:
                    choice[src] = "tcp"
                    segments.pop(src).close()
                else:
                    raise ConnectError(f"peer {src!r} could not set up {choice[src]}: {ack.get('why')}")

        if links.bell is not None:
            links.bell.seg.unlink()  # every peer that will ring it has mapped it by now

        # 6. torch pairs: two-rank groups, built in one global order of pairs
        prefixes: dict[tuple[str, str], tuple[str, str]] = {}
        for dst, offer in offers.items():
            if offer["transport"] == "torch":
                prefixes[(name, dst)] = (offer["prefix"], offer["backend"])
        for src, offer in my_offers.items():
            if choice[src] == "torch":
                prefixes[(src, name)] = (offer["prefix"], offer["backend"])
        groups: dict[tuple[str, str], dist.ProcessGroup] = {}
        _, device = _torch_backend(config)
        for pair in sorted(prefixes):
            prefix, backend = prefixes[pair]
            rem = max(1.0, deadline - _now())
            try:
                groups[pair] = make_group(dist.PrefixStore(prefix, store), 0 if pair[0] == name else 1,
                                          backend, device, rem)
            except Exception as e:
                peer = pair[1] if pair[0] == name else pair[0]
                raise ConnectError(f"torch.distributed ({backend}) group with peer {peer!r} failed: {e}") from e

        # 7. channels
        for dst, s in out.items():
            offer = offers[dst]
            t, ns, sb = offer["transport"], int(offer["num_slots"]), int(offer["slot_bytes"])
            if t == "shm":
                links.send[dst] = ShmSendChannel(dst, s, attached.pop(dst), ns, sb, links.peer_bells[dst])
            elif t == "tcp":
                links.send[dst] = TcpSendChannel(dst, s, ns, sb)
            else:
                links.send[dst] = TorchSendChannel(dst, s, ns, sb, groups[(name, dst)], device)
        for src, conn in inc.items():
            t, ns, sb = choice[src], config.num_slots, config.slot_bytes
            if t == "shm":
                links.recv[src] = ShmRecvChannel(src, conn, segments.pop(src), ns, sb, links.peer_bells[src])
            elif t == "tcp":
                links.recv[src] = TcpRecvChannel(src, conn, ns, sb)
            else:
                links.recv[src] = TorchRecvChannel(src, conn, ns, sb, groups[(src, name)], device)
        for s in list(out.values()) + list(inc.values()):
            s.setblocking(False)
        if links.bell is not None and not any(ch.transport == "shm"
                                              for ch in list(links.send.values()) + list(links.recv.values())):
            links.bell.close()
            links.bell = None
        return links
    except BaseException:
        links.close()
        for sk in list(out.values()) + list(inc.values()):
            sk.close()
        for seg in list(segments.values()) + list(attached.values()):
            seg.close()
        raise
    finally:
        if lsock is not None:
            lsock.close()
