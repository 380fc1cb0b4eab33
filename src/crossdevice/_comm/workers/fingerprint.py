"""Collective fingerprints: what each worker is about to do, compared before data moves.

Every numbered cross-worker collective starts with one all-gather of a fixed-size int64
header (`HEADER_LEN` values, 672 bytes) from every worker. The header says what this
worker is about to do: sequence number, kind, reduce op, local replica count, number of
buffers, byte count, digests of the dtypes, shapes, value structure and buffer layout,
a state the caller asks every worker to share (`purpose.agreeing`: the gradients'
optimizer hyperparameters), and (for all_gather and broadcast) the one value's rank,
dtype and shape. Because the header has the same size on every worker, Gloo never sees
buffers of different sizes; the result is used only after every worker has checked every
other worker's header, so a mismatch is an error on every worker alike
(`CollectiveMismatchError`), never a SIGABRT in Gloo or a silently wrong sum.

All_gather and broadcast need this exchange anyway (to size their buffers). An
all_reduce whose buffer layout every worker can predict from the collectives they
already agreed on sends its data in the same round trip as the header
(`speculation.py`): Gloo still sees identical sizes on every worker, because each
worker sends the *predicted* layout (zeros when its own call differs), and the result
is kept only when every header matches. Otherwise the data follows the header.

Peer headers are untrusted input: `decode` checks the magic number, every code against
its table and every size against a bound before anything is allocated from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from crossdevice._sync.call import cached_digest as cached_digest
from crossdevice._sync.call import digest as digest

if TYPE_CHECKING:
    import torch

    from crossdevice._comm.protocol import ReduceOptions
    from crossdevice._comm.workers.transport import Layout
    from crossdevice._comm.workers.wire import Wire

__all__ = [
    "HEADER_LEN",
    "KINDS",
    "MAX_NDIM",
    "OPS",
    "SEQ_FIELD",
    "STATE_FIELD",
    "STRUCTURE_FIELD",
    "Fingerprint",
    "ReductionPrints",
    "abort_print",
    "abort_reason",
    "cached_digest",
    "digest",
    "has_data_arg",
    "mismatched_fields",
]

#: "CDF1": tells a crossdevice header from garbage (another program on the group).
_MAGIC: Final = 0x43444631
#: NumPy's own limit on array rank.
MAX_NDIM: Final = 64
_FIXED: Final = 20
HEADER_LEN: Final = _FIXED + MAX_NDIM
#: Where `Fingerprint.encode` puts the sequence number, the structure digest and the state.
SEQ_FIELD: Final = 1
STRUCTURE_FIELD: Final = 9
STATE_FIELD: Final = 16
#: Collective kinds, by code (index + 1).
KINDS: Final = ("all_reduce", "all_gather", "broadcast", "barrier", "has_data", "abort")
#: Reduce ops as the strategy asked for them (the wire always sums), by code (index).
OPS: Final = ("none", "sum", "mean")
#: Fields that every worker's header must share, whatever the kind.
_ALWAYS: Final = ("seq", "kind", "op", "local_replicas", "structure", "state")
#: Fields that must also agree for reductions (all_gather and broadcast sizes may differ
#: by design; their own checks compare rank, dtype, axis, root and shapes).
_REDUCTION: Final = ("buffers", "nbytes", "dtypes", "shapes", "layout", "cuda")


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What one worker is about to do in one numbered collective.

    Attributes:
        seq: the collective's number on this worker (1, 2, ...).
        kind: one of `KINDS`.
        op: the reduce op the caller asked for (`OPS`); the wire always sums.
        local_replicas: the worker's local replica count (0: not a strategy's call).
        buffers: number of buffers (packs, or values for all_gather/broadcast).
        nbytes: total bytes of the buffers.
        dtypes: digest of the buffers' dtypes, in order.
        shapes: digest of the values' shapes, in order (before packing).
        structure: digest of the values' structure (0: none given).
        arg: axis (all_gather) or root (broadcast).
        cuda: the values travel on CUDA (NCCL).
        ndim: the one value's rank for all_gather/broadcast (-1: no value).
        dtype_code: the one value's dtype code (-1: no value).
        shape: the one value's shape.
        layout: digest of the host buffers' wire dtypes and element counts, in order
            (what Gloo will see; 0: none).
        state: what the caller asks every worker to share (`purpose.agreeing`; 0: none),
            set per call on the encoded header (`STATE_FIELD`), never part of a template.
        detail: readable dtypes and shapes, for error messages only (not sent).
    """

    seq: int
    kind: str
    op: str = "none"
    local_replicas: int = 0
    buffers: int = 0
    nbytes: int = 0
    dtypes: int = 0
    shapes: int = 0
    structure: int = 0
    arg: int = 0
    cuda: bool = False
    ndim: int = -1
    dtype_code: int = -1
    shape: tuple[int, ...] = ()
    layout: int = 0
    state: int = 0
    detail: str = dataclasses.field(default="", compare=False)

    def encode(self) -> np.ndarray:
        """The header: `HEADER_LEN` int64 values."""
        header = np.zeros(HEADER_LEN, np.int64)
        header[:17] = (
            _MAGIC,
            self.seq,
            KINDS.index(self.kind) + 1,
            OPS.index(self.op),
            self.local_replicas,
            self.buffers,
            self.nbytes,
            self.dtypes,
            self.shapes,
            self.structure,
            self.arg,
            int(self.cuda),
            self.ndim,
            self.dtype_code,
            len(self.shape),
            self.layout,
            self.state,
        )
        header[_FIXED : _FIXED + len(self.shape)] = self.shape
        return header

    @classmethod
    def decode(cls, header: np.ndarray, *, rank: int, num_dtypes: int) -> Fingerprint:
        """A peer's header, checked: ValueError naming `rank` for anything out of range."""
        values = [int(v) for v in header[:_FIXED]]
        (magic, seq, kind, op, local, buffers, nbytes, dtypes, shapes, structure, arg) = values[:11]
        cuda, ndim, dtype_code, shape_len, layout, state = values[11:17]
        problems = []
        if magic != _MAGIC:
            problems.append(f"magic {magic:#x} (expected {_MAGIC:#x})")
        if not 1 <= kind <= len(KINDS):
            problems.append(f"kind code {kind}")
        if not 0 <= op < len(OPS):
            problems.append(f"op code {op}")
        if not -1 <= ndim <= MAX_NDIM or not 0 <= shape_len <= MAX_NDIM:
            problems.append(f"rank {ndim}")
        if not -1 <= dtype_code < num_dtypes:
            problems.append(f"dtype code {dtype_code}")
        shape = tuple(int(v) for v in header[_FIXED : _FIXED + max(0, min(shape_len, MAX_NDIM))])
        if any(d < 0 for d in shape) or min(seq, local, buffers, nbytes) < 0:
            problems.append("a negative size")
        if problems:
            raise ValueError(
                f"rank {rank} sent a collective header that is not crossdevice's: "
                f"{', '.join(problems)}; every worker must run the same crossdevice version, "
                "and nothing else may use its process groups"
            )
        return cls(
            seq=seq,
            kind=KINDS[kind - 1],
            op=OPS[op],
            local_replicas=local,
            buffers=buffers,
            nbytes=nbytes,
            dtypes=dtypes,
            shapes=shapes,
            structure=structure,
            arg=arg,
            cuda=bool(cuda),
            ndim=ndim,
            dtype_code=dtype_code,
            shape=shape,
            layout=layout,
            state=state,
        )

    def describe(self) -> str:
        """One line: `all_reduce #3 op=sum local_replicas=2 buffers=1 nbytes=24 ...`."""
        text = (
            f"{self.kind} #{self.seq} op={self.op} local_replicas={self.local_replicas} "
            f"buffers={self.buffers} nbytes={self.nbytes} dtypes={self.dtypes:014x} "
            f"shapes={self.shapes:014x} structure={self.structure:014x} layout={self.layout:014x}"
        )
        if self.state:
            text += f" state={self.state:014x}"
        if self.kind in ("all_gather", "broadcast"):
            text += f" arg={self.arg} ndim={self.ndim} shape={self.shape}"
        return text


def abort_print(seq: int, error_type: str, local_replicas: int) -> Fingerprint:
    """The header a failing worker sends: kind `abort`, its exception's type name."""
    name = error_type.encode("ascii", "replace")[:MAX_NDIM]
    return Fingerprint(
        seq, "abort", local_replicas=local_replicas, ndim=len(name), shape=tuple(name)
    )


def has_data_arg(has_data: bool, steps: int | None) -> int:
    """A has-data header's `arg`: the flag in bit 0, `steps + 1` above it (0: no count)."""
    return int(bool(has_data)) + (0 if steps is None else 2 * (steps + 1))


def has_data_size(size: int | None) -> tuple[int, ...]:
    """A has-data header's `shape`: `(size + 1,)` for a global batch size, else `()`.

    A has-data header has no values, so its shape fields (never compared for this kind)
    carry the size: the workers' sizes are compared by `has_data.answer`.
    """
    return () if size is None else (size + 1,)


def abort_reason(p: Fingerprint) -> str:
    """The exception type name an abort header carries (bounded, printable ASCII only)."""
    text = "".join(chr(c) if 32 <= c < 127 else "?" for c in p.shape[:MAX_NDIM])
    return text or "an exception"


def mismatched_fields(prints: Sequence[Fingerprint]) -> list[str]:
    """The fields on which the workers' fingerprints differ (empty: they all agree)."""
    fields: tuple[str, ...] = _ALWAYS
    if all(p.kind in ("all_reduce", "has_data") for p in prints):
        fields += _REDUCTION
    return [f for f in fields if len({getattr(p, f) for p in prints}) > 1]


def mismatch_message(
    prints: Sequence[Fingerprint], details: Sequence[str], fields: list[str]
) -> str:
    """The `CollectiveMismatchError` message: each worker's fingerprint, then the diff."""
    lines = [
        f"workers are about to run collectives that do not match (fields that differ: "
        f"{', '.join(fields)}); no data was exchanged. Each worker's fingerprint:"
    ]
    for rank, (p, detail) in enumerate(zip(prints, details, strict=True)):
        lines.append(f"  rank {rank}: {p.describe()}")
        if detail:
            lines.append(f"          {detail}")
    lines.append(
        "Every worker must call the same collectives in the same order with values of the "
        "same dtypes, shapes and structure, the same reduce op and the same number of local "
        "replicas. A worker that caught an exception in its step and carried on is the usual "
        "cause of a sequence mismatch; workers that read global batches of different sizes "
        "in one step differ in the global batch their step's calls show."
    )
    if "structure" in fields:
        lines.append(
            "The structure differs: the calls came from different lines of the program (each "
            "worker's detail shows `from file:line`) or reduce values nested differently "
            "({'a': x} against [x]). Make a collective from one line on every worker, not "
            "from one line per branch of `if rank == 0:`."
        )
    if "shapes" in fields:
        lines.append(
            "The shapes differ: the values' shapes, their dtypes, or their array library (a "
            "NumPy array on one worker, a torch tensor on another) are not the same."
        )
    if "state" in fields:
        lines.append(
            "The state differs: what every worker's call must share besides (for "
            "crossdevice.torch's gradients: the optimizer's hyperparameters, the "
            "zero_grad() calls since its last step, the writes to parameters, buffers and "
            "optimizer state outside the step, the eval-mode modules and the frozen "
            "parameters, the changes to the reduced gradients before the last step, "
            "compared by value, shown above for each worker; and whether the call "
            "belongs to a strategy.run in flight). Do these on every worker "
            "alike (a scheduler stepped on every worker, not on the chief only; a "
            "checkpoint loaded on every worker; a clip to the global norm; noise drawn "
            "from a generator seeded alike on every worker), or on none."
        )
    return "\n".join(lines)


#: Bytes of readable detail each worker sends when a mismatch was found.
DETAIL_BYTES: Final = 1024


def encode_detail(text: str) -> np.ndarray:
    """`text` as `DETAIL_BYTES` uint8 values (UTF-8, cut, NUL padded)."""
    data = text.encode("utf-8", "replace")[:DETAIL_BYTES]
    out = np.zeros(DETAIL_BYTES, np.uint8)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    return out


def decode_detail(data: np.ndarray) -> str:
    """A peer's detail: bounded, undecodable bytes replaced, control characters dropped."""
    text = bytes(data[:DETAIL_BYTES].tobytes()).rstrip(b"\0").decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


class ReductionPrints:
    """All-reduces' encoded fingerprints with sequence number 0, remembered.

    A training step repeats its all-reduces, and with them everything of their
    fingerprints but the number (`header[SEQ_FIELD]`, set per call on a copy).
    """

    def __init__(self) -> None:
        self._prints: dict[Any, np.ndarray] = {}

    def all_reduce(
        self,
        opts: ReduceOptions,
        wires: Sequence[Wire],
        tensors: Sequence[torch.Tensor],
        layout: Layout | None,
        local_replicas: int,
    ) -> np.ndarray:
        """The template of an all-reduce of `wires` (flattened to `tensors`).

        `layout`: the buffers it sends (None: not predicted; its digest is 0).
        """
        signature = opts.signature
        key = (
            signature,
            opts.op,
            tuple(
                (w.dtype, w.tensor.dtype, tuple(w.tensor.shape), w.tensor.is_cuda) for w in wires
            ),
            local_replicas,
        )
        template = self._prints.get(key)
        if template is None:
            template = Fingerprint(
                seq=0,
                kind="all_reduce",
                op=(signature.argument if signature is not None else opts.op.name).lower(),
                local_replicas=local_replicas,
                buffers=len(wires),
                nbytes=sum(t.numel() * t.element_size() for t in tensors),
                dtypes=cached_digest(tuple(w.tensor.dtype for w in wires)),
                shapes=(
                    signature.shapes_digest()
                    if signature is not None
                    else cached_digest(tuple((tuple(w.tensor.shape), w.dtype) for w in wires))
                ),
                structure=0 if signature is None else signature.structure_digest(),
                cuda=any(t.is_cuda for t in tensors),
                layout=0 if layout is None else digest(layout),
            ).encode()
            if len(self._prints) >= 256:
                self._prints.clear()
            self._prints[key] = template
        return template
