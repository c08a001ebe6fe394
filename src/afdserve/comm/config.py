"""Configuration of a Communicator (fixed at connect time)."""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.errors import ConfigError

TRANSPORTS = ("auto", "shm", "tcp", "torch", "cuda_ipc")
MAX_SLOTS = 64


@dataclass(frozen=True)
class CommConfig:
    """Options of one Communicator.

    The receiving side of a pair owns the registered buffer, so ``slot_bytes`` / ``num_slots`` of the
    *receiver* define the pair's geometry; the sender learns them in the handshake.
    """

    slot_bytes: int = 4 << 20  # payload capacity of one slot (tensors, each rounded up to 64 bytes)
    num_slots: int = 4  # slots per pair = messages in flight per pair (>= micro-batches in flight)
    # auto (same machine -> cuda_ipc if both ends' device is CUDA, else shm; across machines tcp) | shm | tcp
    # | torch | cuda_ipc
    transport: str = "auto"
    deadline_s: float = 0.2  # default deadline of every wait (send for a free slot, recv)
    connect_timeout_s: float = 60.0  # rendezvous + handshakes
    spin_s: float = 100e-6  # busy-poll up to this long before blocking (adaptive, see progress.py)
    host: str | None = None  # address to advertise for TCP; None: the interface that reaches the store
    machine_id: str | None = None  # identity for transport="auto" (equal ids -> shm); None: hostname + boot id
    torch_backend: str = "auto"  # transport="torch": gloo | nccl | auto (nccl iff device is cuda)
    # torch and cuda_ipc: where the registered slots live (cuda:N for nccl; cuda_ipc needs cuda[:N]); under
    # auto, a CUDA device on both ends of a pair on one machine makes it try cuda_ipc
    device: str = "cpu"

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise ConfigError(f"invalid {name}={getattr(self, name)!r}: {why}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        check("slot_bytes", is_int(self.slot_bytes) and self.slot_bytes >= 0, "must be an integer >= 0")
        check("num_slots", is_int(self.num_slots) and 1 <= self.num_slots <= MAX_SLOTS,
              f"must be an integer in [1, {MAX_SLOTS}]")
        check("transport", self.transport in TRANSPORTS, f"use one of {', '.join(TRANSPORTS)}")
        for name in ("deadline_s", "connect_timeout_s"):
            v = getattr(self, name)
            check(name, isinstance(v, (int, float)) and v > 0, "must be > 0 seconds")
        check("spin_s", isinstance(self.spin_s, (int, float)) and self.spin_s >= 0, "must be >= 0 seconds")
        check("machine_id", self.machine_id is None or (isinstance(self.machine_id, str) and self.machine_id != ""),
              "must be a non-empty string or None")
        check("device", isinstance(self.device, str) and (self.transport != "cuda_ipc"
                                                          or self.device.split(":")[0] == "cuda"),
              "transport='cuda_ipc' needs the slots on a CUDA device (device='cuda' or 'cuda:N')")
        check("torch_backend", self.torch_backend in ("auto", "gloo", "nccl"), "use auto, gloo or nccl")
