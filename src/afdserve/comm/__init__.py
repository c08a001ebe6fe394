"""afdserve.comm: the M2N library moving tokens between attention and expert workers.

Buffers are registered once per pair at connect time; a sender writes straight into the receiver's
slot and raises a completion carrying size and sequence number; a receiver waits only for the
peers it names, with a deadline on every wait. Transports: shared memory (same machine), CUDA IPC
(same machine, tensors on GPUs: device-to-device copies), TCP (across machines) and
torch.distributed point-to-point (baseline / fallback).
"""

from afdserve.comm.communicator import Communicator, connect
from afdserve.comm.config import CommConfig
from afdserve.comm.errors import (
    CommError,
    ConnectError,
    PayloadTooLargeError,
    PeerClosedError,
    PeerDeadError,
    PeerError,
    PeerTimeoutError,
    SlotBusyError,
)
from afdserve.comm.header import MAX_META_INTS, MAX_NDIM, MAX_TENSORS, payload_nbytes
from afdserve.comm.message import Message, Meta
from afdserve.comm.shm import list_segments, sweep_shm

__all__ = [
    "Communicator", "connect", "CommConfig", "Meta", "Message", "payload_nbytes",
    "MAX_TENSORS", "MAX_NDIM", "MAX_META_INTS", "sweep_shm", "list_segments",
    "CommError", "ConnectError", "PayloadTooLargeError", "SlotBusyError",
    "PeerError", "PeerDeadError", "PeerClosedError", "PeerTimeoutError",
]
