"""`crossdevice demo`: the shipped data, the model's gradient, and the command end to end."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from crossdevice._cli import demo, demo_common, demo_numpy
from crossdevice._data.digits import load_digits, train_test_split


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="crossdevice")
    demo.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["demo", *argv])


def test_shipped_digits() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 64)
    assert images.dtype == np.uint8
    assert (images.min(), images.max()) == (0, 16)
    assert labels.shape == (1797,)
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_train_test_split_is_seeded_and_disjoint() -> None:
    x = np.arange(100).reshape(50, 2)
    y = np.arange(50)
    a = train_test_split(x, y, 0.2, seed=3)
    b = train_test_split(x, y, 0.2, seed=3)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    train_y, test_y = a[1], a[3]
    assert len(test_y) == 10
    assert sorted([*train_y, *test_y]) == list(range(50))
    with pytest.raises(ValueError, match=r"test_fraction must be in \(0, 1\)"):
        train_test_split(x, y, 1.0, seed=0)


def test_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(0)
    params = [p.astype(np.float64) for p in demo_numpy.init_params(1, hidden=5)]
    params = [p + 0.1 * rng.standard_normal(p.shape) for p in params]
    x = rng.random((7, 64))
    labels = rng.integers(0, 10, 7)
    _, _, grads = demo_numpy.loss_and_grad_sums(params, x, labels)
    eps = 1e-6
    for k, p in enumerate(params):
        for index in np.ndindex(p.shape):
            bumped = [q.copy() for q in params]
            bumped[k][index] += eps
            up = demo_numpy.loss_and_grad_sums(bumped, x, labels)[0].sum()
            bumped[k][index] -= 2 * eps
            down = demo_numpy.loss_and_grad_sums(bumped, x, labels)[0].sum()
            assert abs((up - down) / (2 * eps) - grads[k][index]) < 1e-6, (k, index)


def test_gradient_of_split_batches_adds_up() -> None:
    # Data parallelism rests on this: the sum of per-slice gradient sums is the gradient
    # sum of the whole batch, including an empty slice (a replica without data).
    rng = np.random.default_rng(1)
    params = demo_numpy.init_params(0)
    x = rng.random((9, 64)).astype(np.float32)
    labels = rng.integers(0, 10, 9)
    losses, correct, whole = demo_numpy.loss_and_grad_sums(params, x, labels)
    parts = [
        demo_numpy.loss_and_grad_sums(params, x[a:b], labels[a:b])
        for a, b in [(0, 5), (5, 9), (9, 9)]
    ]
    assert parts[2][0].shape == (0,)
    assert all(not g.any() for g in parts[2][2])
    for k in range(4):
        np.testing.assert_allclose(sum(p[2][k] for p in parts), whole[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([p[0] for p in parts]), losses, rtol=1e-6)
    assert correct.shape == (9,)


def test_epoch_batches_cover_every_example_once() -> None:
    x = np.arange(20).reshape(10, 2)
    batches = demo_common.epoch_batches(x, np.arange(10), 4, seed=5)
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    assert sorted(np.concatenate([labels for _, labels in batches]).tolist()) == list(range(10))
    assert all(np.array_equal(xb[:, 0] // 2, yb) for xb, yb in batches)


def test_register_defaults_and_flags() -> None:
    args = parse()
    assert args.func is demo.run
    assert (args.replicas, args.epochs, args.batch_size, args.cross_device_ops, args.seed) == (
        4,
        10,
        64,
        "default",
        0,
    )
    args = parse("--replicas", "2", "--epochs", "3", "--batch-size", "32", "--seed", "7")
    assert (args.replicas, args.epochs, args.batch_size, args.seed) == (2, 3, 32, 7)
    assert parse("--cross-device-ops", "hierarchical_copy").cross_device_ops == "hierarchical_copy"


@pytest.mark.parametrize(
    "argv",
    [("--replicas", "0"), ("--epochs", "x"), ("--cross-device-ops", "ring")],
    ids=["zero-replicas", "epochs-not-int", "unknown-ops"],
)
def test_bad_flags_exit_with_usage(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert "demo" in capsys.readouterr().err


def test_demo_end_to_end(torch_module: object, capsys: pytest.CaptureFixture[str]) -> None:
    # The main job: the torch CNN, mirrored with crossdevice.torch, on 4 replicas.
    args = parse("--replicas", "4")
    assert args.func(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "PyTorch CNN" in out
    assert "MirroredStrategy on 4 replicas (logical CPU devices" in out
    assert out.count("held-out accuracy ") == 10  # one line per epoch
    accuracy = float(out.split("held-out accuracy: ")[1].split()[0])
    assert accuracy >= 0.95
    assert "parameters match" in out
    assert "identical on all 4 replicas" in out
    assert out.rstrip().endswith("demo: OK")
    assert captured.err == ""  # no progress bars when stderr is not a terminal


def test_bf16_demo_is_within_half_a_point_of_float32(
    torch_module: object, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse("--replicas", "4", "--mixed-precision", "bf16", "--no-progress")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    bf16, float32 = (
        float(x)
        for x in out.split("bf16 check: held-out accuracy ")[1]
        .split(" on ")[0]
        .split(" against float32's ")
    )
    assert abs(bf16 - float32) <= 0.005
    assert "(within 0.5 points); replica copies identical" in out
    assert out.rstrip().endswith("demo: OK")
    args = parse("--numpy", "--mixed-precision", "bf16")
    with pytest.raises(SystemExit, match="applies to the torch model"):
        args.func(args)


def test_numpy_demo_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--numpy", "--replicas", "2", "--epochs", "3")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "NumPy MLP 64-64-10" in out
    assert out.count("held-out accuracy ") == 3
    assert "parameters match" in out
    assert out.rstrip().endswith("demo: OK")


@pytest.mark.parametrize("ops", sorted(demo.CROSS_DEVICE_OPS))
def test_demo_with_each_cross_device_ops(ops: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "--numpy", "--replicas", "3", "--epochs", "3", "--cross-device-ops", ops, "--no-progress"
    )
    assert args.func(args) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "parameters match" in out
    assert "identical on all 3 replicas" in out


def test_demo_fails_when_accuracy_is_too_low(capsys: pytest.CaptureFixture[str]) -> None:
    # One step on the whole training set cannot learn the digits: the exit status says so.
    args = parse(
        "--numpy", "--replicas", "2", "--epochs", "1", "--batch-size", "2000", "--no-progress"
    )
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "FAILED: needs >= 0.90" in out
    assert out.rstrip().endswith("demo: FAILED")


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c")  # the demo keeps an ignored SIGINT ignored
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_demo_saves_on_a_signal_and_the_same_command_resumes(
    torch_module: object, tmp_path: Path, signum: int
) -> None:
    command = [sys.executable, "-m", "crossdevice", "demo", "--replicas", "2", "--no-progress"]
    command += ["--checkpoint-dir", str(tmp_path)]
    lines = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:  # bounded: the demo ends by itself if nothing stops it
            lines.append(line)
            if "epoch   1/10" in line:
                process.send_signal(signum)
        process.wait(timeout=120)
    output = "".join(lines)
    assert process.returncode == 42, output
    saved = re.search(r"saved \S+/ckpt-\d+ at step (\d+); run the same command to resume", output)
    assert saved is not None, output
    step = int(saved.group(1))
    assert 23 < step < 230  # in epoch 2 or later, not at its end
    if signum == signal.SIGINT:
        return
    again = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    epoch = step // 23 + 1
    assert f"resumed at epoch {epoch}, step {step} (from {tmp_path})" in again.stdout
    assert again.stdout.count("held-out accuracy ") == 10 - epoch + 1  # the rest of the run
    assert again.stdout.rstrip().endswith("demo: OK")


def test_ctrl_c_becomes_a_termination_notice_unless_the_process_ignores_it() -> None:
    """The demo saves on Ctrl-C, but a process started with SIGINT ignored keeps ignoring it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `nohup ... &`
    try:
        assert demo_common._ctrl_c_as_sigterm() is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert demo_common._ctrl_c_as_sigterm() is signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.default_int_handler)
    finally:
        signal.signal(signal.SIGINT, previous)
