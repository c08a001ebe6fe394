"""CUDA IPC transport for workers on one node: the payload goes device to device, in one copy.

The shared-memory protocol (``shm_transport.py``) unchanged: headers and the FILLED / FREED words
stay in the host segment (the host knows the shapes); only the payload lives elsewhere, in slots the
receiver allocates in its device memory and offers at the handshake as CUDA IPC handles
(``torch.multiprocessing.reductions``), so a send is one device-to-device copy per tensor into the
receiver's slot (same GPU, or across GPUs: NVLink when the two can reach each other).

Ordering on the GPU, with no host sync on either side, through two interprocess CUDA events per slot
(created by the receiver, opened by the sender): the sender records ``filled[s]`` after its copy
(then stores FILLED on the host); the receiver's stream waits on it before the tensors are read
(``take``). The receiver records ``freed[s]`` when the message is released (then stores FREED); the
sender's stream waits on it before it copies the next message into that slot. Both waits are taken
on the *current* stream of the slots' device at ``recv`` / ``send`` time, and the release is
recorded on the current stream at ``release``: work reading a message on another stream must be
ordered before the release by the caller, as for any CUDA tensor.

A record always comes (on the host) before the completion word its waiter reads, so a wait never
sees an older record of the event (``cudaStreamWaitEvent`` uses the latest record at call time).

The receiver owns the memory and all the events, so a dead sender leaves it nothing unsafe to use.
A dead receiver's memory and events are freed with its process, and CUDA leaves further use of the
imports undefined: the sender looks at the pair's socket before every send (EOF: PeerDeadError), which
leaves the window of a receiver dying while a copy into its slots is queued or running.

At connect time (``handshake.py``) the sender opens the handles and a round trip through the device
memory and the events must pass (``probe_*``); otherwise the pair falls back to shared memory.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import torch

from afdserve.comm.header import TensorDesc
from afdserve.comm.slots import SlotBuffer, slot_stride

_MASK = (1 << 62) - 1


def gpu_uuid(device: str) -> str | None:
    """The UUID of ``device`` if it names a CUDA device this process can use, else None."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if dev.index is None else dev.index
    if idx >= torch.cuda.device_count():
        return None
    return str(torch.cuda.get_device_properties(idx).uuid)


def _index_of(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"the receiver's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES?)")


class DevicePayload:
    """The ``Payload`` strategy of ``shm_transport``: slots in (the receiver's) device memory."""

    transport = "cuda_ipc"
    dies_with_peer = True  # the sender's side: the receiver's allocation and events

    def __init__(self, mem: torch.Tensor, num_slots: int, slot_bytes: int, filled: list[torch.cuda.Event],
                 freed: list[torch.cuda.Event]) -> None:
        self.buf = SlotBuffer(num_slots, slot_bytes, tensor=mem)
        self.device = mem.device
        self.filled = filled
        self.freed = freed

    def write(self, slot: int, tensors: Sequence[torch.Tensor], descs: Sequence[TensorDesc], reuse: bool) -> None:
        stream = torch.cuda.current_stream(self.device)
        if reuse:
            stream.wait_event(self.freed[slot])  # the receiver's last read of this slot
        self.buf.write(slot, tensors, descs)  # a copy from another GPU is ordered before this stream
        self.filled[slot].record(stream)

    def views(self, slot: int, descs: Sequence[TensorDesc]) -> list[torch.Tensor]:
        torch.cuda.current_stream(self.device).wait_event(self.filled[slot])
        return self.buf.tensors(slot, descs)

    def consumed(self, slot: int) -> None:
        self.freed[slot].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self.buf.release()
        self.filled, self.freed = [], []

    # -- the connect-time probe ----------------------------------------------------------------------
    def _probe_words(self) -> torch.Tensor:
        p = self.buf.payload_offset(0)
        return self.buf.u8[p: p + 16].view(torch.int64)


def export(device: str, num_slots: int, slot_bytes: int) -> tuple[DevicePayload, dict]:
    """Receiver: allocate the slots and events on ``device``; returns them and the offer's ``ipc`` part.

    Slot 0 holds a random probe value, which the sender must read back (``probe_sender``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    dev = torch.device(device)
    if dev.index is None:  # "cuda": this process's current device
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(dev):
        mem = torch.zeros(num_slots * slot_stride(slot_bytes), dtype=torch.uint8, device=dev)
        events = [torch.cuda.Event(interprocess=True) for _ in range(2 * num_slots)]
        for e in events:
            e.record()  # created on this device
        slots = DevicePayload(mem, num_slots, slot_bytes, events[:num_slots], events[num_slots:])
        probe = secrets.randbits(62)
        slots._probe_words().copy_(torch.tensor([probe, probe ^ _MASK]))
        torch.cuda.synchronize(dev)
        args = reduce_tensor(mem)[1]
    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage bytes, storage offset,
    #  requires_grad, ref counter handle, ref counter offset, event handle, event sync required)
    storage = [args[8], args[9], args[11], args[12], args[13], args[14]]
    return slots, {"uuid": gpu_uuid(device), "numel": mem.numel(), "handle": args[7].hex(),
                   "storage": [v.hex() if isinstance(v, bytes) else v for v in storage],
                   "events": [e.ipc_handle().hex() for e in events], "probe": probe}


def open_peer(ipc: dict, num_slots: int, slot_bytes: int) -> DevicePayload:
    """Sender: open the receiver's slots and events (raises if this process cannot)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError("CUDA is not available in this process")
    idx = _index_of(str(ipc["uuid"]))
    size, off, rc_handle, rc_off, ev_handle, ev_sync = ipc["storage"]
    numel = int(ipc["numel"])
    if numel != num_slots * slot_stride(slot_bytes):
        raise ValueError(f"the receiver offers {numel} bytes of slots, expected {num_slots} x {slot_bytes}")
    mem = rebuild_cuda_tensor(torch.Tensor, (numel,), (1,), 0, torch.storage.TypedStorage, torch.uint8, idx,
                              bytes.fromhex(ipc["handle"]), size, off, False, bytes.fromhex(rc_handle), rc_off,
                              None if ev_handle is None else bytes.fromhex(ev_handle), ev_sync)
    dev = torch.device("cuda", idx)
    events = [torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(h)) for h in ipc["events"]]
    return DevicePayload(mem, num_slots, slot_bytes, events[:num_slots], events[num_slots:])


def probe_sender(slots: DevicePayload, probe: int) -> None:
    """Sender, at connect time: read the receiver's probe value, answer it through slot 0 and ``filled[0]``."""
    with torch.cuda.device(slots.device):
        words = slots._probe_words()
        got = words.tolist()
        if got != [probe, probe ^ _MASK]:
            raise ValueError(f"the receiver's slots read back {got}, not the probe value it wrote")
        words.copy_(torch.tensor([probe ^ _MASK, probe]))
        slots.filled[0].record(torch.cuda.current_stream(slots.device))


def probe_receiver(slots: DevicePayload, probe: int) -> None:
    """Receiver, once the sender acknowledged: its answer must be visible after ``filled[0]``."""
    with torch.cuda.device(slots.device):
        torch.cuda.current_stream(slots.device).wait_event(slots.filled[0])
        got = slots._probe_words().tolist()
    if got != [probe ^ _MASK, probe]:
        raise ValueError(f"the sender's answer to the probe reads {got} here (device writes or events across "
                         "processes do not work)")
