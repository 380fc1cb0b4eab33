"""How a mirrored module's buffers combine across replicas after a forward pass.

A buffer that a forward pass changes (BatchNorm's running statistics, a counter, a
running maximum) changes on each replica from that replica's slice of the batch. TF
gives every such variable an aggregation (`tf.VariableAggregation`); here each buffer
has one, applied after every training-mode forward inside `strategy.run`:

* `"mean"`: the replicas' values averaged (BatchNorm's `running_mean` and `running_var`,
  the default: TF aggregates moving statistics with MEAN);
* `"sum"`: the replicas' *changes* added (`old + sum(new_r - old)`): a counter of
  examples seen counts the global batch;
* `"max"`: the largest replica's value;
* `"first_replica"`: replica 0's value;
* `"none"`: each replica keeps its own (they may then differ; BatchNorm's integer
  `num_batches_tracked` counts the same on every replica, so it needs nothing).

Changes made any other way inside `strategy.run` (a submodule called directly, an
eval-mode forward) are combined by the same rule when the run ends (`settle`).

A change is seen by the buffer's version counter, which some writers leave alone: a
write through `.data` (`buf.data.mul_(d)`, `buf.data = x`, the habit of EMA code),
`F.batch_norm` on a module's own statistics, and quantization-aware training's fused
observers (`FusedMovingAvgObsFakeQuantize`, torch's default QAT qconfig:
`torch.fused_moving_avg_obs_fake_quant` updates `min_val`, `max_val`, `scale` and
`zero_point` in place). So undeclared buffers are also compared by value with a copy of
what the replicas agreed on: the fused observers' after every forward (a few scalars),
the others after each replica's forwards 1-4, then 8, 16, 32, ... (and at the ends of
runs on the same schedule), where a writer that bypasses the counter is found at its
first forward and a later one at the next power of two.

Spectral norm's `u` and `v` (its power iteration reads only the weight, so every replica
computes them alike) need no rule. Any other integer or floating buffer with no declared
aggregation that a forward pass changes is an error naming it, also one every replica
changed alike (a count of examples in slices of one size is alike, and the global
batch's count is their sum): `prepare(..., buffer_aggregation={"name": "sum"})`
declares it (names as in `named_buffers()`, `fnmatch` patterns allowed). Inside one
forward a replica reads its own update, as on one device of that slice: combining
happens after the pass, so a layer that reads a statistic it has just updated sees its
replica's value, not the global batch's (`SyncBatchNorm` computes BatchNorm's over the
global batch).
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
from collections.abc import Mapping, Sequence
from typing import Final

import torch

from crossdevice._core.coerce import coerce_enum
from crossdevice._core.reduce_op import ReduceOp
from crossdevice._strategies.context import get_replica_context

__all__ = ["AGGREGATIONS", "BufferSync", "no_examples", "resolve_aggregations"]


#: The aggregations a buffer can declare.
class Aggregation(enum.StrEnum):
    """What a buffer's replicas agree on after a training-mode forward (`buffer_aggregation`)."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    FIRST_REPLICA = "first_replica"
    NONE = "none"


AGGREGATIONS: Final = tuple(m.value for m in Aggregation)
_NORM_STATS: Final = ("running_mean", "running_var")
#: Forwards (per replica) after which every undeclared buffer is compared by value: the
#: first few, then the powers of two (a copy and a compare of each buffer).
_ALWAYS_COMPARED: Final = 4


def resolve_aggregations(
    module: torch.nn.Module, declared: Mapping[str, str] | None, sync_buffers: bool
) -> dict[str, str | None]:
    """Each buffer's aggregation (None: undeclared, an error if a forward changes it).

    Raises:
        TypeError: `declared` is not a mapping of names to strings.
        ValueError: an unknown aggregation, a name matching no buffer, or `"mean"` for
            an integer buffer.
    """
    from crossdevice._frameworks.torch.batchnorm import SyncBatchNorm

    if declared is not None and not isinstance(declared, Mapping):
        raise TypeError(
            "buffer_aggregation must map buffer names (or fnmatch patterns) to one of "
            f"{list(AGGREGATIONS)}, got {type(declared).__name__}: {declared!r}"
        )
    declared = dict(declared or {})
    for pattern, value in declared.items():
        key = repr(pattern).replace("{", "{{").replace("}", "}}")
        message = f"buffer_aggregation[{key}] must be one of {{choices}}, got {{value}}"
        declared[pattern] = coerce_enum(value, Aggregation, message=message).value
    names = dict(module.named_buffers())
    for pattern in declared:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(
                f"buffer_aggregation names {pattern!r}, which matches no buffer of the module; "
                f"its buffers are {sorted(names)}"
            )
    owners = {
        f"{prefix}.{name}" if prefix else name: sub
        for prefix, sub in module.named_modules()
        for name in sub._buffers
    }
    result: dict[str, str | None] = {}
    for name, buffer in names.items():
        how = _declared(declared, name)
        owner = owners.get(name)
        leaf = name.rsplit(".", 1)[-1]
        if how is None and not sync_buffers:
            how = "none"
        if how is None and isinstance(owner, torch.nn.modules.batchnorm._NormBase):
            if isinstance(owner, SyncBatchNorm):
                how = "none"  # global statistics: equal on every replica already
            elif leaf in _NORM_STATS:
                how = "mean"
            elif leaf == "num_batches_tracked":
                how = "none"  # one per forward on every replica: equal
        if how == "mean" and not buffer.is_floating_point():
            raise ValueError(
                f"buffer {name!r} holds {buffer.dtype} values, which cannot be averaged "
                "exactly; declare 'sum', 'max', 'first_replica' or 'none' for it"
            )
        result[name] = how
    return result


def _declared(declared: Mapping[str, str], name: str) -> str | None:
    """The aggregation the first matching pattern declares for `name`, if any."""
    for pattern, how in declared.items():
        if fnmatch.fnmatchcase(name, pattern):
            return how
    return None


class BufferSync:
    """One replica set's buffers, combined across replicas after each forward pass.

    A forward of the mirrored module combines them when it returns (`after_forward`).
    Whatever else changes a buffer inside `strategy.run` (a submodule called directly,
    `model.module(x)`, an eval-mode forward) is found when the run ends, or at a
    `merge_call`, and combined there by the same rule (`settle`): the replicas' buffers
    never silently differ.

    Args:
        replicas: every local replica's module (same structure).
        aggregations: `resolve_aggregations` of replica 0.
        replicas_in_sync: every replica of every worker (default: the local ones).
    """

    def __init__(
        self,
        replicas: Sequence[torch.nn.Module],
        aggregations: Mapping[str, str | None],
        replicas_in_sync: int | None = None,
    ) -> None:
        self._slots: list[list[tuple[torch.nn.Module, str]]] = []
        for replica in replicas:
            owners = dict(replica.named_modules())
            slots = []
            for name in aggregations:
                prefix, _, leaf = name.rpartition(".")
                slots.append((owners[prefix], leaf))
            self._slots.append(slots)
        self._root = replicas[0]
        self._local = len(replicas)
        self._in_sync = len(replicas) if replicas_in_sync is None else replicas_in_sync
        self._names = list(aggregations)
        self._how = [aggregations[n] for n in self._names]
        self._synced = [k for k, h in enumerate(self._how) if h not in (None, "none")]
        self._watched = [k for k, h in enumerate(self._how) if h is None]
        # Spectral norm's power iteration reads only the weight: alike on every replica.
        self._alike = {k for k in self._watched if _spectral_norm_owns(*self._slots[0][k])}
        # Written in place without a version bump on every forward: compared by value.
        self._unversioned = {
            k for k in self._watched if _unversioned_writer_owns(replicas[0], self._names[k])
        }
        # Values the replicas agreed on last, to add changes to ("sum").
        self._agreed: list[dict[int, torch.Tensor]] = [{} for _ in replicas]
        self._seen: list[list[tuple[int, int]]] = []
        # The undeclared buffers' values as last seen unchanged or agreed on (`_compared`)
        self._copies: list[dict[int, torch.Tensor]] = [{} for _ in replicas]
        self._forwards = [0] * len(replicas)
        self._settles = 0
        for r in range(len(replicas)):
            self._seen.append(self._marks(r, self._watched))
            self._keep_agreed(r)
            self._keep_copies(r, self._watched)

    @property
    def active(self) -> bool:
        """Whether any buffer is combined or watched after a forward pass."""
        return bool(self._synced or self._watched)

    def _buffer(self, replica: int, k: int) -> torch.Tensor:
        module, leaf = self._slots[replica][k]
        return module._buffers[leaf]  # type: ignore[return-value]

    def _marks(self, replica: int, indices: list[int]) -> list[tuple[int, int]]:
        marks = []
        for k in indices:
            buffer = self._buffer(replica, k)
            marks.append((id(buffer), buffer._version))
        return marks

    def _keep_agreed(self, replica: int) -> None:
        for k in self._synced:
            if self._how[k] == "sum":
                self._agreed[replica][k] = self._buffer(replica, k).detach().clone()

    def _keep_copies(self, replica: int, ks: list[int]) -> None:
        for k in ks:
            self._copies[replica][k] = self._buffer(replica, k).detach().clone()

    def _changed_watched(
        self, replica: int, every_value: bool
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The watched buffers `replica` changed since they were last seen.

        By version, and by value for those whose writers may leave the version alone
        (all of them if `every_value`).
        """
        now = self._marks(replica, self._watched)
        changed = {
            k
            for k, before, after in zip(self._watched, self._seen[replica], now, strict=True)
            if before != after
        }
        copies = self._copies[replica]
        for k in self._watched if every_value else self._unversioned:
            if k not in changed and not torch.equal(self._buffer(replica, k), copies[k]):
                changed.add(k)
        return sorted(changed), now

    def _compared(self, replica: int) -> bool:
        """Count a forward of `replica`; whether every watched buffer's value is compared."""
        self._forwards[replica] += 1
        return _scheduled(self._forwards[replica])

    def after_forward(self, replica: int, training: bool, empty: bool = False) -> None:
        """Combine the declared buffers (training mode), refuse undeclared changes.

        Spectral norm's `u` and `v`, which every replica changes alike (from the weight
        only), are kept as they are. A replica whose batch was `empty` (a last batch
        smaller than the replica count) updated no statistic: "mean" buffers average the
        other replicas' only (its unchanged value diluted the update).
        """
        if self._watched:
            changed, now = self._changed_watched(replica, self._compared(replica))
            if changed:
                counts = [k for k in changed if not self._buffer(replica, k).is_floating_point()]
                if counts:
                    self._undeclared(counts, "integer")
                ctx = get_replica_context()
                assert ctx is not None
                gathered = ctx.all_gather(
                    [self._buffer(replica, k).unsqueeze(0) for k in changed], 0
                )
                differ = [
                    k
                    for k, stacked in zip(changed, gathered, strict=True)
                    if not all(torch.equal(stacked[0], other) for other in stacked[1:])
                ]
                if differ:
                    self._undeclared(differ, "different")
                alike = [k for k in changed if k not in self._alike]
                if alike and self._in_sync > 1:
                    self._undeclared(alike, "alike")
                self._seen[replica] = now
                self._keep_copies(replica, changed)
        if not training or not self._synced:
            return
        ctx = get_replica_context()
        assert ctx is not None
        groups: dict[str, list[int]] = {}
        for k in self._synced:
            groups.setdefault(self._how[k], []).append(k)  # type: ignore[arg-type]
        values: dict[int, torch.Tensor] = {}
        if "mean" in groups:
            ks = groups["mean"]
            mine = [self._buffer(replica, k) for k in ks]
            if empty:
                mine = [torch.zeros_like(b) for b in mine]
            # SUM, then divide by the replicas that saw examples (MEAN's own division
            # when every replica did); the count stays on the device (no sync).
            seen = (torch.zeros if empty else torch.ones)((), device=mine[0].device)
            *sums, count = ctx.all_reduce(ReduceOp.SUM, [*mine, seen])
            if not empty or float(count) > 0:  # (every batch empty: nothing changed)
                values.update((k, t / count) for k, t in zip(ks, sums, strict=True))
        if "sum" in groups:
            ks = groups["sum"]
            agreed = self._agreed[replica]
            deltas = [self._buffer(replica, k) - agreed[k] for k in ks]
            reduced = ctx.all_reduce(ReduceOp.SUM, deltas)
            values.update((k, agreed[k] + d) for k, d in zip(ks, reduced, strict=True))
        picked = groups.get("max", []) + groups.get("first_replica", [])
        if picked:
            gathered = ctx.all_gather([self._buffer(replica, k).unsqueeze(0) for k in picked], 0)
            for k, stacked in zip(picked, gathered, strict=True):
                values[k] = stacked.amax(0) if self._how[k] == "max" else stacked[0].clone()
        # New tensors rather than copy_: the forward just run may have saved the old ones
        # for its backward, and an in-place write would fail that backward's version check.
        for k, value in values.items():
            module, leaf = self._slots[replica][k]
            module._buffers[leaf] = _ordinary(value)
        self._keep_agreed(replica)

    def _undeclared(self, ks: list[int], why: str, outside: bool = False) -> None:
        """Refuse undeclared buffers `ks` that changed, `why`; `outside` a forward (`settle`)."""
        names = [self._names[k] for k in ks]
        reason = {
            "integer": "they hold integers (a count may be of examples or of steps)",
            "different": "the replicas' values differ: each replica changed them from "
            "its own slice of the batch",
            "alike": "every replica changed them to the same value, which says nothing: a "
            "value computed from the parameters or the step count is alike, and so is a "
            "count of examples when the slices have one size (each replica counted only "
            "its own: the global batch's count is their sum)",
        }[why]
        observers = [n for n in names if _quantization_owns(self._root, n)]
        hint = (
            ". Those of quantization observers and fake-quantizers (quantization-aware "
            "training) take 'first_replica', as DDP broadcasts rank 0's buffers "
            "(broadcast_buffers): replica 0's min_val, max_val, scale and zero_point, "
            "consistent with each other. Declare it for all of them, with the names "
            "torch's prepare_qat gives: buffer_aggregation={'*activation_post_process*': "
            "'first_replica', '*weight_fake_quant*': 'first_replica'}"
            if observers
            else ""
        )
        where = (
            "code inside strategy.run outside the mirrored module's forward (a backward "
            "hook, the step function or an optimizer hook)"
            if outside
            else "the forward pass"
        )
        instead = (
            "change them alike on every replica"
            if outside
            else "change them outside the forward pass"
        )
        raise RuntimeError(
            f"{where} changed buffer(s) {names} of a mirrored module, which have "
            f"no declared aggregation, and {reason}. Declare how the replicas combine "
            f"them, prepare(..., buffer_aggregation={{{names[0]!r}: ...}}), with one of: "
            "'mean' for running statistics (BatchNorm's running mean and variance), 'sum' "
            "for counters of examples (every replica's changes added), 'max' for running "
            "maxima, 'first_replica' for values every replica computes alike (replica "
            f"0's), 'none' to let each replica keep its own; or {instead}{hint}"
        )

    def settle(self) -> None:
        """Combine what changed outside a forward of the mirrored module (a run ended).

        Called in cross-replica code while no replica runs: the local replicas' values
        are combined here by each buffer's rule; across workers that needs a forward of
        the mirrored module (an error says so).

        Raises:
            RuntimeError: an undeclared buffer changed to values that differ, an
                undeclared integer buffer changed, or a buffer changed outside a forward
                of the mirrored module on several workers.
        """
        replicas = range(self._local)
        if self._watched:
            self._settles += 1
            every_value = _scheduled(self._settles)
            changes = [self._changed_watched(r, every_value) for r in replicas]
            changed = sorted({k for ks, _ in changes for k in ks})
            if changed:
                if self._in_sync != self._local:
                    self._across_workers(changed)
                counts = [k for k in changed if not self._buffer(0, k).is_floating_point()]
                if counts:
                    self._undeclared(counts, "integer", outside=True)
                differ = [
                    k
                    for k in changed
                    if not all(
                        torch.equal(
                            self._buffer(0, k), self._buffer(r, k).to(self._buffer(0, k).device)
                        )
                        for r in replicas
                    )
                ]
                if differ:
                    self._undeclared(differ, "different", outside=True)
                alike = [k for k in changed if k not in self._alike]
                if alike and self._in_sync > 1:
                    self._undeclared(alike, "alike", outside=True)
                for r, (ks, now) in zip(replicas, changes, strict=True):
                    self._seen[r] = now
                    self._keep_copies(r, ks)
        # BatchNorm's kernels update running statistics without a version bump: the
        # values tell. Replicas that agree on a "mean", "max" or "first_replica" buffer
        # have nothing to combine; a "sum" one is compared with what they agreed on.
        changed = [k for k in self._synced if self._differs(k)]
        if not changed:
            return
        if self._in_sync != self._local:
            self._across_workers(changed)
        with torch.no_grad():
            for k in changed:
                self._combine_locally(k)
        for r in replicas:
            self._keep_agreed(r)

    def after_failed_run(self) -> None:
        """Agree again among the local replicas after a run that raised; never raise.

        The run may have stopped between a replica's update of a buffer and its
        combining (`after_forward`), so the local replicas' values may differ. Each
        declared buffer is combined among them by its rule, as `settle` does (BatchNorm's
        statistics then hold the mean of what the replicas saw, as plain torch keeps the
        update of a forward that raised after it); each undeclared one that changed
        takes replica 0's value, and the next forward that changes it is checked as
        usual. Nothing is exchanged with other workers: their replicas may now differ
        from these (the run's exception, often a `WorkerFailedError`, says the strategy
        is broken across workers; after an error every worker raised alike, the next
        forward's combining brings "mean", "max" and "first_replica" buffers back
        together, while "sum" ones keep what each worker added).
        """
        with torch.no_grad():
            for k in self._watched:
                first = self._buffer(0, k)
                for r in range(1, self._local):
                    mine = self._buffer(r, k)
                    if not torch.equal(first, mine.to(first.device)):
                        module, leaf = self._slots[r][k]
                        module._buffers[leaf] = first.detach().to(mine.device, copy=True)
            for k in self._synced:
                if self._differs(k):
                    self._combine_locally(k)
        for r in range(self._local):
            self.refresh(r)

    def _differs(self, k: int) -> bool:
        if self._how[k] == "sum":
            return any(
                not torch.equal(self._buffer(r, k), self._agreed[r][k]) for r in range(self._local)
            )
        first = self._buffer(0, k)
        return any(
            not torch.equal(first, self._buffer(r, k).to(first.device))
            for r in range(1, self._local)
        )

    def _combine_locally(self, k: int) -> None:
        values = [self._buffer(r, k).detach() for r in range(self._local)]
        device = values[0].device
        how = self._how[k]
        if how == "mean":
            value = values[0].clone()
            for other in values[1:]:
                value += other.to(device)
            value /= len(values)
        elif how == "sum":
            agreed = self._agreed[0][k]
            value = agreed.clone()
            for r, other in enumerate(values):
                value += other.to(device) - self._agreed[r][k].to(device)
        elif how == "max":
            value = torch.stack([v.to(device) for v in values]).amax(0)
        else:  # first_replica
            value = values[0].clone()
        for r in range(self._local):
            module, leaf = self._slots[r][k]
            module._buffers[leaf] = value.to(values[r].device, copy=True)

    def _across_workers(self, ks: list[int]) -> None:
        names = [self._names[k] for k in ks]
        raise RuntimeError(
            f"buffer(s) {names} of a mirrored module changed inside strategy.run outside a "
            "forward of the mirrored module itself (a submodule called directly, "
            "model.module(x), or an eval-mode forward), and the replicas span several "
            "workers, whose buffers only a forward of the mirrored module combines. Call "
            "the prepared model itself (model(x)) for the forward passes that change them"
        )

    def follow_first(self) -> None:
        """Give every local replica replica 0's buffers (a cross-replica forward ran).

        By value: BatchNorm's kernels update running statistics without a version bump,
        so the mirror's section rule (`mirroring.py`), which follows versions, misses
        them. Each replica's buffers then count as agreed (a "sum" adds to them).
        """
        if self._local == 1:
            return
        with torch.no_grad():
            for k in range(len(self._names)):
                first = self._buffer(0, k)
                for r in range(1, self._local):
                    mine = self._buffer(r, k)
                    if first is None or mine is None or torch.equal(first, mine.to(first.device)):
                        continue
                    module, leaf = self._slots[r][k]
                    module._buffers[leaf] = _ordinary(first.detach()).to(mine.device, copy=True)
        for r in range(self._local):
            self.refresh(r)

    def refresh(self, replica: int) -> None:
        """Buffers were set from outside (a copy from replica 0): watch from here."""
        self._seen[replica] = self._marks(replica, self._watched)
        self._keep_agreed(replica)
        self._keep_copies(replica, self._watched)


def _scheduled(count: int) -> bool:
    return count <= _ALWAYS_COMPARED or count & (count - 1) == 0


def _unversioned_writer_owns(module: torch.nn.Module, name: str) -> bool:
    """Whether a module on `name`'s path writes it in place without a version bump.

    QAT's fused observer (`FusedMovingAvgObsFakeQuantize`, torch's default qconfig)
    updates its own `scale` and `zero_point` and its observer's `min_val` and `max_val`
    through `torch.fused_moving_avg_obs_fake_quant`, on every forward.
    """
    fused = getattr(
        importlib.import_module("torch.ao.quantization.fake_quantize"),
        "FusedMovingAvgObsFakeQuantize",
        (),
    )
    parts = name.split(".")[:-1]
    for depth in range(len(parts) + 1):
        owner = module.get_submodule(".".join(parts[:depth]))
        if isinstance(owner, fused):
            return True
    return False


def _quantization_owns(module: torch.nn.Module, name: str) -> bool:
    """Whether `name` is a buffer of torch's quantization observers or fake-quantizers."""
    parts = name.split(".")[:-1]
    return any(
        type(module.get_submodule(".".join(parts[:depth]))).__module__.startswith(
            "torch.ao.quantization"
        )
        for depth in range(len(parts) + 1)
    )


def _spectral_norm_owns(module: torch.nn.Module, leaf: str) -> bool:
    """Whether torch's spectral norm keeps the buffer `leaf` of `module` (its `u`, `v`)."""
    from torch.nn.utils import parametrizations

    if isinstance(module, parametrizations._SpectralNorm):
        return leaf in ("_u", "_v")
    old = importlib.import_module("torch.nn.utils.spectral_norm").SpectralNorm
    return any(
        isinstance(hook, old) and leaf in (f"{hook.name}_u", f"{hook.name}_v")
        for hook in module._forward_pre_hooks.values()
    )


def no_examples(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether a forward's first tensor argument is an empty batch.

    A last batch smaller than the replica count leaves some replicas an empty slice: their
    BatchNorm statistics do not move.
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.ndim > 0 and value.shape[0] == 0
    return False


def _ordinary(value: torch.Tensor) -> torch.Tensor:
    """`value`, or an ordinary copy of it if made under `torch.inference_mode()`.

    A training-mode forward there combines the buffers into inference tensors, which
    cannot be written outside it (and every run reads their version counter, which they
    lack). Plain torch updates its own buffer in place there, an ordinary tensor still.
    """
    if not value.is_inference():
        return value
    with torch.inference_mode(False):
        return value.clone()
