"""What this worker should do besides training: TF 2's `StrategyExtended` role flags.

Part of `StrategyExtended` (a base class of it). Values are TF 2.21's:

| strategy | checkpoint, summary | should_init | between_graph |
|---|---|---|---|
| Mirrored, OneDevice | True | True | False |
| MultiWorkerMirrored | on the chief only | True | True |
| CentralStorage | True | True | True |
| default | True | True | False |

(TF's default strategy raises NotImplementedError for the last two; one process with
one device needs initialising and runs one graph, so we answer.)
"""

from __future__ import annotations

__all__ = ["WorkerRoles"]


class WorkerRoles:
    """`should_checkpoint`, `should_save_summary`, `experimental_should_init`, `..._between_graph`.

    Strategies set `_is_chief` (False on the non-chief workers of a multi-worker job)
    and `_between_graph` (True where TF's strategy says so).
    """

    #: This worker is the chief (TF's `multi_worker_util.is_chief`): always on one worker.
    _is_chief = True
    #: TF's `experimental_between_graph`: True for MultiWorkerMirrored and CentralStorage.
    _between_graph = False

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should write checkpoints: the chief only (TF 2).

        Example:
            >>> import crossdevice
            >>> crossdevice.MirroredStrategy(["CPU:0"]).extended.should_checkpoint
            True
        """
        return self._is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (TensorBoard): the chief only (TF 2)."""
        return self._is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker should initialise variables: every worker (TF 2)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own program (graph) for its replicas (TF 2).

        True for `MultiWorkerMirroredStrategy` and `CentralStorageStrategy`, as in TF;
        False for Mirrored, OneDevice and the default strategy.
        """
        return self._between_graph
