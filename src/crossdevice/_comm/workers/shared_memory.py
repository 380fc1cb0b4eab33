"""Workers on one host all-reduce through shared memory, not through TCP loopback.

Gloo moves every byte between two processes of one machine through the kernel's TCP
loopback, and every Gloo op costs a round trip of thread wake-ups: on the 2-core host a
14-element all-reduce takes about 1 ms and 64 MiB about 50 ms (ten times a memory copy).
NCCL, MPI and Horovod use shared memory between the processes of a node; Gloo does not.
So when every worker runs on this host (the common `torchrun --nproc-per-node N`), a
large host all-reduce goes through per-worker slots in `/dev/shm`:

    round c (the layout cut into rounds of at most SLOT_BYTES):
        every worker writes its part of round c into its own slot of parity c % 2
        (round 0 also its fingerprint header), then sets its round counter to c
        every worker waits (futex) until every peer's counter has reached c
        round 0: every worker compares all the headers (not equal: the Gloo header
        exchange follows and names the differences, as in `speculation.py`)
        every worker sums all workers' slots, in rank order, into its own result

Every worker computes the same sums in the same order: the results are bitwise equal on
every worker. Two parity sets make one barrier per round enough: a worker writes a slot
of parity p again only after the next round's barrier, which no worker passes before
every worker has finished reading that slot. The waits are futex waits on the peers'
counters, bounded by the collective's timeout and interrupted every
`TUNING.poll_seconds` to consult the health board, so a dead or failed peer is
reported as for Gloo. A worker that leaves the rounds (its fill raised, an interrupt,
a failed wait, its own timeout, its step's abort) sets a poison mark in its segment,
with the round it left at and why, and wakes its peers, who raise `WorkerFailedError`
naming it instead of summing slots it never wrote, or wrote for a round it then gave
up: a round counts as complete only once no peer's mark says it left at or before it
(a peer that timed out had arrived; a late one finds every counter there, and the
mark). Only x86-64 Linux: its stores become visible in program order
(the summing kernel fences its non-temporal stores), so a counter seen set means the
data before it is there.

Set-up (`SharedSlots.connect`) happens once per communicator: each worker creates its
segment (mode 0600, space reserved with `posix_fallocate`, so a full `/dev/shm` fails
here and not later with SIGBUS), the workers exchange the names and a random nonce over
Gloo, each maps every peer's segment and checks the nonce, and a second exchange says
whether all of them could; it also carries every worker's
`CROSSDEVICE_SHARED_MEMORY_MIN_BYTES`, which must be equal (workers must choose the same
transport for every layout). Then, or when the set-up fails, each worker unlinks its own
file (the mappings stay): nothing is left in `/dev/shm`, even when a worker is killed
later (only a kill within the set-up's two exchanges can leave one). If any worker cannot (other
hosts or containers, no `/dev/shm`, no space, another platform,
`CROSSDEVICE_SHARED_MEMORY=0`), every worker keeps to Gloo. Only processes of the same
user can open the files: the trust model is the one of `/dev/shm`, inside that of the
cluster network (see the multi-worker guide).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import platform
import secrets
import sys
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import torch

from crossdevice._arrays import host_kernels
from crossdevice._core import environment, tuning

__all__ = [
    "ENV_VAR",
    "MIN_BYTES_ENV_VAR",
    "SLOT_BYTES",
    "Round",
    "SharedSlots",
    "min_bytes_from_env",
    "plan_rounds",
    "uses_shared_memory",
]

#: `CROSSDEVICE_SHARED_MEMORY=0` keeps every all-reduce on Gloo.
ENV_VAR: Final = "CROSSDEVICE_SHARED_MEMORY"
#: The smallest all-reduce (bytes) sent through shared memory (default: the tuning's).
MIN_BYTES_ENV_VAR: Final = "CROSSDEVICE_SHARED_MEMORY_MIN_BYTES"
#: Bytes of one slot: a round's data. Two per worker (the parities), so each worker
#: reserves 2 x SLOT_BYTES of `/dev/shm` (Docker's default `/dev/shm` is 64 MiB).
SLOT_BYTES: Final = 8 * 1024 * 1024
_SUMMED_DTYPES: Final = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
_ALIGN: Final = 64
_NAME_BYTES: Final = 96
_DIR: Final = "/dev/shm"
#: Segment layout: nonce | counter | poison mark | the round it left at | the length of
#: why it left | why it left (text) | two headers | two data slots.
_COUNTER: Final = 64
_POISON: Final = 68
_LEFT: Final = 72
_SAID: Final = 76
_REASON: Final = 128
#: The longest reason kept (a peer's abort record in the store keeps 300 characters).
_REASON_BYTES: Final = 384
_HEADERS: Final = _REASON + _REASON_BYTES
_HEADER_SLOT: Final = 8192
_DATA: Final = _HEADERS + 2 * _HEADER_SLOT
_SIZE: Final = _DATA + 2 * SLOT_BYTES
_FUTEX_WAIT: Final = 0  # shared (not FUTEX_PRIVATE_FLAG): the word is in a shared mapping
_FUTEX_WAKE: Final = 1
_SYS_FUTEX_X86_64: Final = 202

#: One round: (buffer index, start element, stop element, byte offset in the slot).
Round = list[tuple[int, int, int, int]]


@functools.lru_cache(maxsize=64)
def plan_rounds(layout: tuple[tuple[torch.dtype, int], ...]) -> list[Round]:
    """Cut `layout`'s buffers into rounds of at most `SLOT_BYTES` (a function of the layout).

    Cached: a training step repeats the same layouts. Do not modify the result.
    """
    rounds: list[Round] = [[]]
    used = 0
    for index, (dtype, numel) in enumerate(layout):
        itemsize = dtype.itemsize
        start = 0
        while start < numel:
            room = (SLOT_BYTES - used) // itemsize
            if room <= 0:
                rounds.append([])
                used = 0
                continue
            stop = min(numel, start + room)
            rounds[-1].append((index, start, stop, used))
            used += -(-(stop - start) * itemsize // _ALIGN) * _ALIGN
            start = stop
    return rounds


def uses_shared_memory(layout: Sequence[tuple[torch.dtype, int]], min_bytes: int) -> bool:
    """Whether an all-reduce of `layout` goes through the shared slots (when connected).

    Layouts of at least `min_bytes` of the dtypes whose sums NumPy and Gloo compute
    alike (bool, float16, bfloat16 and complex stay on Gloo).
    """
    return (
        all(dtype in _SUMMED_DTYPES for dtype, _ in layout)
        and sum(dtype.itemsize * numel for dtype, numel in layout) >= min_bytes
    )


def min_bytes_from_env() -> int:
    """`CROSSDEVICE_SHARED_MEMORY_MIN_BYTES` (default `TUNING.shared_memory_min_bytes`), checked."""
    value = environment.env_int(MIN_BYTES_ENV_VAR, minimum=0, what="a byte count")
    return tuning.TUNING.shared_memory_min_bytes if value is None else value


class SharedSlots:
    """This worker's slots and its peers', mapped from `/dev/shm`.

    Built by `connect` (None when any worker cannot use shared memory). Each segment:
    a nonce, the worker's round counter (a futex word), its poison mark (with the round
    it left at, and why), one fingerprint header per parity, then one data slot per
    parity.
    """

    def __init__(self, rank: int, maps: list[mmap.mmap], min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        self._rank = rank
        self._maps = maps
        self._bytes = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        self._counters = [b[_COUNTER : _COUNTER + 4].view(np.uint32) for b in self._bytes]
        self._poison = [b[_POISON : _POISON + 4].view(np.uint32) for b in self._bytes]
        self._left = [b[_LEFT : _LEFT + 4].view(np.uint32) for b in self._bytes]
        self._said = [b[_SAID : _SAID + 4].view(np.uint32) for b in self._bytes]
        self._addresses = [b.ctypes.data + _COUNTER for b in self._bytes]
        self._round = 0
        #: The last round whose barrier this worker passed (the transport sets it).
        self.passed = 0

    # -- set-up --------------------------------------------------------------------------

    @classmethod
    def connect(
        cls, rank: int, world_size: int, exchange: Callable[[torch.Tensor], np.ndarray]
    ) -> SharedSlots | None:
        """Set up shared slots with every worker, or None on every worker.

        `exchange(tensor)` all-gathers a small tensor into a (world_size, ...) array;
        every worker must call this at the same point (two exchanges). Raises ValueError
        on every worker when a worker's `CROSSDEVICE_SHARED_MEMORY` or
        `CROSSDEVICE_SHARED_MEMORY_MIN_BYTES` is invalid, or the workers' byte counts
        differ (they would choose different transports).
        """
        try:
            min_bytes, bad = min_bytes_from_env(), None
            wanted = environment.env_switch(ENV_VAR, default=True)
        except ValueError as err:  # still take part in the exchanges, then raise
            min_bytes, bad, wanted = -1, err, False
        own: tuple[str, mmap.mmap] | None = None
        nonce = secrets.token_bytes(16)
        if wanted and world_size > 1 and _futex_ok():
            own = _create(_SIZE, nonce)
        maps: list[mmap.mmap] = []
        try:
            entry = np.zeros(_NAME_BYTES + 16, dtype=np.uint8)
            if own is not None:
                name = own[0].encode()
                entry[: len(name)] = np.frombuffer(name, dtype=np.uint8)
                entry[_NAME_BYTES:] = np.frombuffer(nonce, dtype=np.uint8)
            table = exchange(torch.from_numpy(entry))
            ok = own is not None
            for r in range(world_size):
                if own is None or not ok:
                    break
                segment = own[1] if r == rank else _open_peer(table[r])
                if segment is None:
                    ok = False
                else:
                    maps.append(segment)
            flags = exchange(torch.tensor([int(ok), min_bytes], dtype=torch.int64))
        except BaseException:
            _close_all(maps, own)
            raise
        finally:
            if own is not None:  # every peer has it mapped now, or gave up
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(_DIR, own[0]))
        settings = [int(v) for v in flags[:, 1]]
        invalid = [r for r, v in enumerate(settings) if v < 0]
        usable = bool(flags[:, 0].all())
        problem = bad
        if problem is None and invalid:
            problem = ValueError(
                f"rank(s) {invalid} have an invalid {ENV_VAR} or {MIN_BYTES_ENV_VAR} (see "
                "their error); expected a switch (1 or 0) and a byte count >= 0 on every "
                "worker: fix it there or unset it"
            )
        elif problem is None and usable and len(set(settings)) > 1:
            listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(settings))
            problem = ValueError(
                f"{MIN_BYTES_ENV_VAR} differs between the workers ({listed}); expected the "
                "same value on every worker (they must choose the same transport): set it "
                "alike everywhere or unset it"
            )
        if problem is not None or not usable:
            _close_all(maps, own)
            if problem is not None:
                raise problem
            return None
        return cls(rank, maps, min_bytes)

    def close(self) -> None:
        """Unmap every segment (results handed out are private buffers)."""
        self._bytes, self._counters, self._poison, self._left, self._said = [], [], [], [], []
        for m in self._maps:
            with contextlib.suppress(Exception):  # BufferError while a view lives on
                m.close()
        self._maps = []

    # -- data path -----------------------------------------------------------------------

    def carries(self, layout: Sequence[tuple[torch.dtype, int]]) -> bool:
        """Whether an all-reduce of `layout` goes through these slots (`uses_shared_memory`)."""
        return uses_shared_memory(layout, self.min_bytes)

    def next_round(self) -> tuple[int, int]:
        """The next round's number (from 1, mod 2**32) and parity; every worker counts alike."""
        self._round += 1
        return self._round & 0xFFFFFFFF, self._round % 2

    def write(
        self,
        parity: int,
        spec: Round,
        sources: Sequence[torch.Tensor],
        writer: Callable[[int, int, int, np.ndarray], bool] | None = None,
    ) -> None:
        """Put this worker's elements of round `spec` into its slot of `parity`.

        `writer(index, start, stop, out)` computes them straight into the slot (a local
        sum, the caller's copy) when it can (returns True); else they are copied from
        `sources`.
        """
        mine = self._bytes[self._rank]
        base = _DATA + parity * SLOT_BYTES
        for index, start, stop, offset in spec:
            src = sources[index].reshape(-1)[start:stop].numpy()
            dst = _view(mine, base + offset, src)
            if writer is None or not writer(index, start, stop, dst):
                np.copyto(dst, src)

    def arrive(self, number: int, parity: int, header: np.ndarray | None = None) -> None:
        """Publish round `number` (after its data and, given, its header) and wake the peers."""
        if header is not None:
            at = _HEADERS + parity * _HEADER_SLOT
            self._bytes[self._rank][at : at + header.nbytes] = header.view(np.uint8)
        self._counters[self._rank][0] = number  # x86-64: after the data, in order
        _futex(self._addresses[self._rank], _FUTEX_WAKE, 0x7FFFFFFF, None)

    def poison(self, reason: str = "") -> None:
        """Mark this worker as gone from the shared rounds (it quit) and wake the peers.

        A worker that leaves must not let its peers go on summing its slots: its counter
        says nothing more, so they would wait until the timeout, or (had it moved the
        counter: it arrived, then gave up waiting) read data nobody else will sum with
        theirs. Peers check the mark at every wait, after the counters (`abandoned`). The
        mark keeps the first round this worker did not pass the barrier of: the rounds
        before it are whole on every worker. `reason` says why it quit (the first one
        given is kept): a peer names it even when the store is gone with its host.
        """
        if not self._poison:
            return
        rank = self._rank
        if reason and not self._said[rank][0]:
            text = reason.encode("utf-8", "replace")[:_REASON_BYTES]
            self._bytes[rank][_REASON : _REASON + len(text)] = np.frombuffer(text, np.uint8)
            self._said[rank][0] = len(text)  # x86-64: after the text, in order
        if not self._poison[rank][0]:
            self._left[rank][0] = (self.passed + 1) & 0xFFFFFFFF
            self._poison[rank][0] = 1  # after the round it left at, in order
        _futex(self._addresses[rank], _FUTEX_WAKE, 0x7FFFFFFF, None)

    def abandoned(self, number: int) -> list[int]:
        """The peers that quit (`poison`) before passing round `number`'s barrier."""
        return [
            r
            for r, word in enumerate(self._poison)
            if word[0]
            and r != self._rank
            and not (number - int(self._left[r][0])) & 0x80000000  # left at or before
        ]

    def reason(self, rank: int) -> str | None:
        """Why peer `rank` quit, as it said when it poisoned its segment; None if it did not."""
        size = min(int(self._said[rank][0]), _REASON_BYTES)
        if not size:
            return None
        raw = self._bytes[rank][_REASON : _REASON + size].tobytes()
        return "".join(c if c.isprintable() else "?" for c in raw.decode("utf-8", "replace"))

    def waiting_for(self, number: int) -> list[int]:
        """The ranks whose counter has not reached round `number` yet."""
        return [
            r
            for r, counter in enumerate(self._counters)
            if (int(counter[0]) - number) & 0x80000000  # behind, modulo 2**32
        ]

    def wait(self, number: int, rank: int, seconds: float) -> None:
        """Sleep until `rank`'s counter moves from what it is, or `seconds` pass."""
        seen = int(self._counters[rank][0])
        if (seen - number) & 0x80000000:
            _futex(self._addresses[rank], _FUTEX_WAIT, seen, seconds)

    def headers_equal(self, parity: int, header: np.ndarray) -> bool:
        """Whether every worker's header of the round of `parity` is `header`, byte for byte."""
        at = _HEADERS + parity * _HEADER_SLOT
        mine = header.tobytes()
        end = at + len(mine)
        return all(b[at:end].tobytes() == mine for b in self._bytes)

    def reduce(self, parity: int, spec: Round, outputs: Sequence[torch.Tensor]) -> None:
        """Sum every worker's slot of `parity` for round `spec`, in rank order, into `outputs`."""
        base = _DATA + parity * SLOT_BYTES
        for index, start, stop, offset in spec:
            out = outputs[index].reshape(-1)[start:stop].numpy()
            parts = [_view(b, base + offset, out) for b in self._bytes]
            # One core per worker process already: no kernel threads on top.
            host_kernels.sum_n(parts, out, parallel=False)


def _view(buffer: np.ndarray, offset: int, like: np.ndarray) -> np.ndarray:
    """`like.size` elements of `like.dtype` at byte `offset` of a segment."""
    return buffer[offset : offset + like.nbytes].view(like.dtype)


def _create(size: int, nonce: bytes) -> tuple[str, mmap.mmap] | None:
    """This worker's segment, its nonce written, space reserved; None if it cannot be had."""
    if not os.path.isdir(_DIR) or not hasattr(os, "posix_fallocate"):
        return None
    name = f"crossdevice-{os.getpid()}-{secrets.token_hex(12)}"
    path = os.path.join(_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # no SIGBUS later: the pages exist now
        segment = mmap.mmap(fd, size)
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    finally:
        os.close(fd)
    segment[: len(nonce)] = nonce
    return name, segment


def _open_peer(entry: np.ndarray) -> mmap.mmap | None:
    """A peer's segment from its exchanged (name, nonce), checked; None if not ours to see."""
    raw = bytes(entry[:_NAME_BYTES]).rstrip(b"\0")
    nonce = bytes(entry[_NAME_BYTES:])
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    # Exchanged names are untrusted: only our own pattern, no path separators.
    if not name.startswith("crossdevice-") or not all(c.isalnum() or c == "-" for c in name):
        return None
    try:
        # Read-write: futex waits need the word writable-mapped on some kernels; we never
        # write a peer's segment.
        fd = os.open(os.path.join(_DIR, name), os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != _SIZE:
            return None
        segment = mmap.mmap(fd, _SIZE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if segment[: len(nonce)] != nonce:  # another host's file of the same name, or stale
        segment.close()
        return None
    return segment


_LIBC: ctypes.CDLL | None = None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_ok() -> bool:
    """Whether futexes work here (x86-64 Linux): a real wake on a word of our own."""
    global _LIBC
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if _LIBC is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            return False
        _LIBC = libc
    word = ctypes.c_uint32(0)
    try:
        _futex(ctypes.addressof(word), _FUTEX_WAKE, 1, None)
    except OSError:
        return False
    return True


def _futex(address: int, op: int, value: int, seconds: float | None) -> None:
    """One futex call (GIL released): WAIT returns early on a wake, a change or a signal.

    Raises OSError for anything but those (and a timeout): a wait that returned at once
    for ever would spin instead of sleeping.
    """
    assert _LIBC is not None
    timeout = None
    if seconds is not None:
        whole = int(seconds)
        timeout = ctypes.byref(_Timespec(whole, int((seconds - whole) * 1e9)))
    result = _LIBC.syscall(
        ctypes.c_long(_SYS_FUTEX_X86_64),
        ctypes.c_void_p(address),
        ctypes.c_int(op),
        ctypes.c_uint32(value),
        timeout,
        None,
        ctypes.c_int(0),
    )
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
            raise OSError(code, f"futex: {os.strerror(code)}")


def _close_all(maps: list[mmap.mmap], own: tuple[str, mmap.mmap] | None) -> None:
    """Unmap the segments mapped so far (our own included)."""
    segments = {id(m): m for m in [*maps, *([own[1]] if own is not None else [])]}
    for segment in segments.values():
        with contextlib.suppress(Exception):
            segment.close()
