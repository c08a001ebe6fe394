"""Connecting a Communicator to its peers: one socket and one registered buffer per directed pair.

Steps (each side knows only its own peers; no step waits on a peer that has nothing to exchange):
 1. listen, publish the endpoint in the store;
 2. for every peer we send to: dial it, send ``hello`` (our transport preference, machine id);
 3. accept one connection per peer we receive from; choose the pair's transport, register the
    slots (create the shared-memory segment; cuda_ipc: also the device slots and their IPC handles),
    reply ``offer`` with the slot geometry;
 4. on every outgoing socket: read the offer, map the segment (verifying its nonce); cuda_ipc: open
    the device slots and answer the probe; reply ``ack`` with the transport settled on;
 5. on every incoming socket: read the ack, unlink the segment's name (nothing stays in /dev/shm);
    cuda_ipc: check the probe's answer, reply ``confirm``;
 5b. cuda_ipc pairs, on the outgoing socket: read the confirm;
 6. torch pairs: build the two-rank process groups in one global order of pairs.
A wait of step i only needs the peer to have finished step i - 1, so no cycle of waits can form.
A pair that may fall back (transport "auto") goes cuda_ipc -> shm -> tcp when a step of its set-up
fails, with the reason logged (logger ``afdserve.comm``).
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from afdserve.comm import cuda_ipc
from afdserve.comm import rendezvous as rdv
from afdserve.comm.channel import RecvChannel, SendChannel
from afdserve.comm import futex
from afdserve.comm.config import TRANSPORTS, CommConfig
from afdserve.comm.doorbell import Doorbell
from afdserve.comm.errors import ConnectError
from afdserve.comm.shm import Segment
from afdserve.comm.shm_transport import ShmRecvChannel, ShmSendChannel, attach_pair_segment, create_pair_segment
from afdserve.comm.tcp_transport import TcpRecvChannel, TcpSendChannel
from afdserve.comm.torch_transport import TorchRecvChannel, TorchSendChannel, make_group

_now = time.monotonic
log = logging.getLogger("afdserve.comm")
HOST_WORDS = ("shm", "cuda_ipc")  # transports whose completion words live in a shared-memory segment


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
        return env if env in TRANSPORTS else "auto"
    return config.transport


def _no_ipc(same_machine: bool, sender_gpu: str | None, receiver_gpu: str | None) -> str | None:
    """Why the pair cannot use cuda_ipc (None: it can try)."""
    if not same_machine:
        return "the two ends run on different machines"
    if sender_gpu is None:
        return "the sender's tensors are not on a CUDA device it can use (CommConfig.device)"
    if receiver_gpu is None:
        return "the receiver's slots are not on a CUDA device it can use (CommConfig.device)"
    return None


def choose_transport(sender_pref: str, receiver_pref: str, same_machine: bool, peer: str,
                     sender_gpu: str | None = None, receiver_gpu: str | None = None) -> tuple[str, bool, str | None]:
    """The pair's transport; whether it may fall back (cuda_ipc -> shm -> tcp, when a step of the
    set-up fails); and, where one end has a GPU but the pair does not try cuda_ipc, why (else None).
    ``*_gpu``: the UUID of each end's CUDA device (``cuda_ipc.gpu_uuid``), None without one."""
    if "auto" not in (sender_pref, receiver_pref) and sender_pref != receiver_pref:
        raise ConnectError(f"peer {peer!r} wants transport {sender_pref!r}, this side {receiver_pref!r}")
    forced = receiver_pref if receiver_pref != "auto" else sender_pref
    if forced == "cuda_ipc":
        why = _no_ipc(same_machine, sender_gpu, receiver_gpu)
        if why is not None:
            raise ConnectError(f"transport cuda_ipc with peer {peer!r} impossible: {why}")
    if forced != "auto":
        return forced, False, None
    host = same_machine and platform.machine() in ("x86_64", "AMD64")
    if sender_gpu is None and receiver_gpu is None:
        return ("shm" if host else "tcp"), True, None
    why = _no_ipc(same_machine, sender_gpu, receiver_gpu)
    if why is None and not host:
        why = f"its host words need x86-64's store order, this machine is {platform.machine()}"
    if why is None:
        return "cuda_ipc", True, None
    return ("shm" if host else "tcp"), True, why


def _fell_back(group: str, pair: str, to: str, why: str) -> None:
    log.info("comm group %r, pair %s: transport %s instead of cuda_ipc: %s", group, pair, to, why)


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
    dev_in: dict[str, cuda_ipc.DevicePayload] = {}  # cuda_ipc pairs: device slots we offer ...
    dev_out: dict[str, cuda_ipc.DevicePayload] = {}  # ... and those we opened
    my_gpu = cuda_ipc.gpu_uuid(config.device)
    links = Links()
    try:
        if futex.AVAILABLE and pref in ("auto",) + HOST_WORDS:
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
                               "machine": me, "bell": bell_name, "gpu": my_gpu})

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
                t, fb, why = choose_transport(str(hello.get("transport")), pref, hello.get("machine") == me, src,
                                              hello.get("gpu"), my_gpu)
            except ConnectError as e:
                rdv.send_frame(conn, {"op": "offer", "error": str(e)})
                raise
            if why is not None:
                _fell_back(group, f"{src}>{name}", t, why)
            if t in HOST_WORDS:  # both ends need the other's doorbell
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
            offer = {"op": "offer", "num_slots": config.num_slots, "slot_bytes": config.slot_bytes,
                     "fallback": fb, "bell": bell_name}
            if t == "cuda_ipc":
                try:
                    dev_in[src], offer["ipc"] = cuda_ipc.export(config.device, config.num_slots, config.slot_bytes)
                except Exception as e:  # any failure to set the device slots up: shared memory, if allowed
                    if not fb:
                        rdv.send_frame(conn, {"op": "offer", "error": f"cuda_ipc impossible: {e}"})
                        raise ConnectError(f"cuda_ipc with peer {src!r} impossible: {e}") from e
                    _fell_back(group, f"{src}>{name}", "shm", f"device slots could not be exported: {e}")
                    t = "shm"
            choice[src], fallback_ok[src] = t, fb
            offer["transport"] = t
            if t in HOST_WORDS:  # cuda_ipc: the payload area only where shm may take over
                host_bytes = config.slot_bytes if t == "shm" or fb else 0
                seg, nonce = create_pair_segment(config.num_slots, host_bytes)
                segments[src] = seg
                offer.update(shm=seg.name, nonce=nonce, host_slot_bytes=host_bytes)
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
            t = offer["transport"]
            ack: dict = {"op": "ack", "ok": True}
            if t in HOST_WORDS:
                try:
                    attached[dst] = attach_pair_segment(offer["shm"], offer["num_slots"], offer["host_slot_bytes"],
                                                        offer["nonce"])
                    if dst not in links.peer_bells:
                        links.peer_bells[dst] = Doorbell.attach(str(offer["bell"]))
                except (OSError, ValueError) as e:
                    ack = {"op": "ack", "ok": False, "why": f"cannot map {offer['shm']}: {e}"}
                    if not offer.get("fallback"):
                        rdv.send_frame(s, ack)
                        raise ConnectError(f"shared memory to peer {dst!r} impossible: {ack['why']}") from e
                    t = "tcp"
            if t == "cuda_ipc":
                try:
                    dev_out[dst] = cuda_ipc.open_peer(offer["ipc"], offer["num_slots"], offer["slot_bytes"])
                    cuda_ipc.probe_sender(dev_out[dst], offer["ipc"]["probe"])
                except Exception as e:  # this process cannot use the receiver's device slots
                    dev_out.pop(dst, None)
                    ack = {"op": "ack", "ok": False, "why": f"cannot open its CUDA IPC slots: {e}"}
                    if not offer.get("fallback"):
                        rdv.send_frame(s, ack)
                        raise ConnectError(f"cuda_ipc to peer {dst!r} impossible: {ack['why']}") from e
                    _fell_back(group, f"{name}>{dst}", "shm", ack["why"])
                    t = "shm"
            offer["transport"] = ack["transport"] = t
            offers[dst] = offer
            rdv.send_frame(s, ack)

        # 5. read acks, unlink segment names; cuda_ipc: check the probe, confirm
        for src, conn in inc.items():
            ack = rdv.recv_frame(conn, deadline, src)
            seg = segments.get(src)
            if seg is not None:
                seg.unlink()
            t = ack.get("transport")
            if t not in (choice[src], "shm", "tcp") or (t != choice[src] and not fallback_ok[src]):
                raise ConnectError(f"peer {src!r} could not set up {choice[src]}: {ack.get('why')}")
            if t != choice[src] and choice[src] == "cuda_ipc":
                _fell_back(group, f"{src}>{name}", t, f"the sender {ack.get('why')}")
            if t == "cuda_ipc":
                try:
                    cuda_ipc.probe_receiver(dev_in[src], my_offers[src]["ipc"]["probe"])
                    confirm: dict = {"op": "confirm", "ok": True}
                except Exception as e:
                    confirm = {"op": "confirm", "ok": False, "why": f"the CUDA IPC probe failed: {e}"}
                rdv.send_frame(conn, confirm)
                if not confirm["ok"]:
                    if not fallback_ok[src]:
                        raise ConnectError(f"cuda_ipc with peer {src!r} impossible: {confirm['why']}")
                    _fell_back(group, f"{src}>{name}", "shm", confirm["why"])
                    t = "shm"
            choice[src] = t
            if t != "cuda_ipc" and src in dev_in:
                dev_in.pop(src).close()
            if t == "tcp" and src in segments:
                segments.pop(src).close()

        # 5b. cuda_ipc pairs we send on: the receiver's verdict on the probe
        for dst, s in out.items():
            if offers[dst]["transport"] == "cuda_ipc":
                confirm = rdv.recv_frame(s, deadline, dst)
                if not confirm.get("ok"):
                    dev_out.pop(dst).close()
                    if not offers[dst].get("fallback"):
                        raise ConnectError(f"cuda_ipc to peer {dst!r} impossible: {confirm.get('why')}")
                    _fell_back(group, f"{name}>{dst}", "shm", str(confirm.get("why")))
                    offers[dst]["transport"] = "shm"

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
            if t in HOST_WORDS:
                links.send[dst] = ShmSendChannel(dst, s, attached.pop(dst), ns, sb, links.peer_bells[dst],
                                                 dev_out.pop(dst, None))
            elif t == "tcp":
                links.send[dst] = TcpSendChannel(dst, s, ns, sb)
            else:
                links.send[dst] = TorchSendChannel(dst, s, ns, sb, groups[(name, dst)], device)
        for src, conn in inc.items():
            t, ns, sb = choice[src], config.num_slots, config.slot_bytes
            if t in HOST_WORDS:
                links.recv[src] = ShmRecvChannel(src, conn, segments.pop(src), ns, sb, links.peer_bells[src],
                                                 dev_in.pop(src, None))
            elif t == "tcp":
                links.recv[src] = TcpRecvChannel(src, conn, ns, sb)
            else:
                links.recv[src] = TorchRecvChannel(src, conn, ns, sb, groups[(src, name)], device)
        for s in list(out.values()) + list(inc.values()):
            s.setblocking(False)
        if links.bell is not None and not any(ch.futex_ok
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
        for dev in list(dev_in.values()) + list(dev_out.values()):
            dev.close()
        raise
    finally:
        if lsock is not None:
            lsock.close()
