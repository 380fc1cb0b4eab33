"""`crossdevice.nn.compute_average_loss` and `scale_regularization_loss`: TF's numbers.

Each expected value is TF 2.21's (`tf.nn.compute_average_loss` on 2 logical CPUs, the bug
hunt of session 55), and each refusal is TF's or a documented stricter rule
(docs/porting.md): the torch version divided by the local batch in cross-replica context,
took a scalar (already averaged) loss, had no `sample_weight`, and took 10.0 as a batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import crossdevice
from tests.conftest import Backend

average = crossdevice.nn.compute_average_loss
regularization = crossdevice.nn.scale_regularization_loss


def _values(x: Any) -> np.ndarray:
    return np.asarray([np.asarray(v) for v in x])


def _per_replica(strategy: Any, fn: Any) -> list[float]:
    return [float(v) for v in strategy.experimental_local_results(strategy.run(fn))]


def test_in_a_replica_the_default_divides_by_the_local_batch_times_the_replicas(
    backend: Backend,
) -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    got = _per_replica(strategy, lambda: average(backend.make(np.float32([1, 2, 3]))))
    assert got == [1.0, 1.0]  # 6 / (3 * 2), as TF
    assert average(backend.make(np.float32([1, 2, 3]))) == 2.0  # no strategy: one replica


def test_sample_weight_scales_the_losses_as_tf(backend: Backend) -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    losses, weights = np.float32([1, 2, 3]), np.float32([1, 0, 2])

    def step() -> Any:
        return average(
            backend.make(losses), sample_weight=backend.make(weights), global_batch_size=6
        )

    assert _per_replica(strategy, step) == pytest.approx([7 / 6, 7 / 6])  # TF: 1.1666666
    assert float(average(backend.make(losses), 2.0, global_batch_size=6)) == 2.0
    # TF's shape rules: [batch, 1] weights for [batch] losses; [batch] for [batch, T].
    column = backend.make(weights[:, None])
    got = average(backend.make(losses), column, global_batch_size=6)
    assert float(got) == pytest.approx(7 / 6, rel=1e-7)
    grid = backend.make(np.float32([[1, 2], [3, 4], [5, 6]]))
    got = average(grid, backend.make(weights), global_batch_size=3)
    assert float(got) == pytest.approx(25 / 3, rel=1e-7)  # (1 + 2 + 0 + 0 + 10 + 12) / 3
    with pytest.raises(ValueError, match=r"sample_weight of shape \(2,\) does not broadcast"):
        average(backend.make(losses), backend.make(np.float32([1, 2])), global_batch_size=3)


def test_weights_keep_the_losses_float64(backend: Backend) -> None:
    # TF casts losses and weights to float32 first; 1 + 1e-12 survives only in float64.
    losses = backend.make(np.float64([1 + 1e-12, 1.0]))
    got = average(losses, backend.make(np.float64([1.0, 1.0])), global_batch_size=1)
    assert np.asarray(got).dtype == np.float64
    assert float(got) == (1 + 1e-12) + 1.0


def test_in_cross_replica_context_it_needs_the_global_batch_size(backend: Backend) -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    losses = backend.make(np.float32([1, 2, 3]))
    with strategy.scope():
        with pytest.raises(RuntimeError, match="cross-replica context without a global_batch"):
            average(losses)
        assert float(average(losses, global_batch_size=6)) == 1.0  # as TF


@pytest.mark.parametrize(
    ("size", "error", "match"),
    [
        (10.0, ValueError, "must be an integer .* got float"),
        (True, ValueError, "must be an integer"),
        (-1, ValueError, "must be non-negative, got -1"),
        (0, ValueError, "global_batch_size=0 for 3 losses"),
    ],
)
def test_a_global_batch_size_that_is_no_count_is_refused(
    backend: Backend, size: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        average(backend.make(np.float32([1, 2, 3])), global_batch_size=size)


def test_integer_scalars_of_any_kind_are_batch_sizes(torch_module: Any) -> None:
    losses = np.float32([1, 2, 3])
    for size in (np.int64(6), np.array(6), torch_module.tensor(6)):
        assert float(average(losses, global_batch_size=size)) == 1.0
    assert float(average(np.zeros(0, np.float32), global_batch_size=0)) == 0.0  # no losses


def test_a_scalar_loss_is_refused_as_tf_does(backend: Backend) -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match="expects per-example losses, a tensor of rank 1"):
        strategy.run(lambda: average(backend.make(np.float32(3.0))))


def test_an_integer_second_argument_asks_for_global_batch_size_by_name(
    backend: Backend,
) -> None:
    # TF's order puts sample_weight second: `average(losses, 64)` weighs every loss 64
    # times in TF; crossdevice.torch once read it as the batch size. Neither silently.
    with pytest.raises(TypeError, match=r"compute_average_loss\(per_example_loss, global_batch"):
        average(backend.make(np.float32([1, 2])), 64)


def test_scale_regularization_loss_gives_each_replica_its_share(backend: Backend) -> None:
    strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    parts = [backend.make(np.float32([1, 2])), backend.make(np.float32(3))]
    assert _per_replica(strategy, lambda: regularization(parts)) == [3.0, 3.0]
    assert _per_replica(strategy, lambda: regularization(parts[0])) == [1.5, 1.5]
    with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica context"):
        regularization(parts)
    with pytest.raises(ValueError, match="empty list"):
        strategy.run(lambda: regularization([]))


def test_results_are_of_the_losses_kind(backend: Backend) -> None:
    got = average(backend.make(np.float32([1, 2])), global_batch_size=4)
    assert type(got).__module__.split(".")[0] == backend.name
    assert np.asarray(got).dtype == np.float32
    assert average([1.0, 2.0], global_batch_size=4).dtype == np.float32  # Python: TF's float32


def test_torch_exports_the_same_functions(torch_module: Any) -> None:
    import crossdevice.torch

    assert crossdevice.torch.compute_average_loss is average
    assert crossdevice.torch.scale_regularization_loss is regularization
    assert average.__module__ == "crossdevice.nn"
