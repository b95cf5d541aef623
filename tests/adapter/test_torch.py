"""KERAS_BACKEND=torch: one process per device, for real (gloo processes on localhost).

Two processes (`keras-accel launch -n 2`) against one process on the global batch, from
every input kind (tests/adapter/_torch_inputs.py): 45 rows in batches of 8, so the last
batch is padded and splits unevenly over the processes; BatchNormalization; SGD with
momentum. Both processes must hold the same numbers, bit for bit; against one process the
only difference is the order of the gradient's sum (one matmul over 8 rows there, two over
4 and an all-reduce here): measured <= 2.4e-7 on these weights and logs, so 1e-5.
"""

import os
import socket
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_inputs.py")
TIMEOUT_S = 300
TOLERANCE = 1e-5
INPUTS = ("arrays", "generator", "pydataset", "tfdata", "dataloader")


def _env(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch", **extra)
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    return env


def _run(command, timeout=TIMEOUT_S, **extra):
    result = subprocess.run(
        command,
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-inputs")
    one = _run([sys.executable, SCRIPT, str(work / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, SCRIPT, str(work / "two")])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    def load(name):
        with np.load(work / f"{name}.npz") as f:
            return dict(f)

    return load("one-0"), load("two-0"), load("two-1")


@pytest.mark.parametrize("kind", INPUTS)
def test_two_processes_train_as_one_on_uneven_data(runs, kind):
    one, first, second = runs
    keys = sorted(k for k in one if k.startswith(f"{kind}/"))
    assert f"{kind}/loss" in keys and f"{kind}/w0" in keys
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    if kind == "arrays":  # The weights moved: a run that trained nothing would match too.
        assert np.abs(one["arrays/w0"] - one["pydataset/w0"]).max() > 1e-3


def test_evaluate_and_predict_are_exact_and_whole(runs):
    one, first, second = runs
    for kind in ("arrays", "dataloader"):
        assert first[f"{kind}/predict"].shape == (45, 3)  # Every row, on every process.
        for name in ("evaluate", "predict"):
            key = f"{kind}/{name}"
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
            np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    assert int(first["recompiles"]) == 0 and int(one["recompiles"]) == 0


def test_the_backward_pass_sends_the_gradients_in_buckets(runs):
    """Every bucket of every step is sent by the backward pass itself (none is left to the
    optimizer's apply): buckets close once they pass 64 bytes, so the 6 weights, last first,
    make 3 ([bias, kernel] of the last Dense, BatchNormalization's [beta, gamma], the first
    Dense's); 4 of the 5 fits train 2 epochs of 6 steps and the generator's 1 epoch; one
    process has no group to send to."""
    one, first, second = runs
    assert int(first["sent_early"]) == int(second["sent_early"]) == 3 * (4 * 12 + 6)
    assert int(one["sent_early"]) == 0
    assert not bool(first["ddp_wrapped"])  # Keras 3.16's own DDP would reduce them again.


def test_a_steps_metrics_are_reduced_where_a_process_reads_its_logs(runs):
    """A batch hook of the chief's alone reads every step's logs (training, validation, an
    evaluation): the global batch's, as one process logs them, with every process reducing
    each step's metrics beside the chief. Where no process reads them (verbose=0, no batch
    hook) the steps skip that reduction: only the results Keras reports are reduced, at each
    epoch's end, not at each of its 6 steps."""
    one, first, second = runs
    for kind in ("train", "test"):
        key = f"read/{kind}"
        assert first[key].shape == one[key].shape == (12, 2), key  # 2 epochs of 6 batches.
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    key = "read/evaluate"  # `evaluate` on its own: 7 batches of 7 rows.
    assert first[key].shape == one[key].shape == (7, 2), key
    np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    assert "read/train" not in second
    assert int(first["read/left"]) == int(second["read/left"]) == 0  # After a failed fit.
    # A model whose steps log a key of their own: Keras reports the last step's logs.
    for key in ("extra/loss", "extra/accuracy"):
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    np.testing.assert_allclose(first["extra/loss"], first["arrays/loss"], rtol=0, atol=TOLERANCE)
    # Each of 24 steps (12 of training, 12 of validation), and each epoch's results.
    assert int(first["reduced/read"]) == int(second["reduced/read"]) >= 24
    for kind in INPUTS:
        key = f"reduced/{kind}"
        assert int(first[key]) == int(second[key]), key
        # One per epoch (2 epochs, the generator's 1), and one as Keras builds the model's
        # metrics (`_symbolic_build`) after each compile.
        epochs = 1 if kind == "generator" else 2
        assert epochs <= int(first[key]) <= epochs + 1, key


COMPILED_SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_compiled_processes.py")
COMPILE_S = 570


def test_compiled_steps_over_processes_train_as_one_compiled_process(tmp_path):
    """`jit_compile=True` over two processes: Keras's steps compiled in each, the gradients'
    average (and, where the chief reads a step's logs, the metrics' reduction) inside the
    program, numbers as one process's (tests/adapter/_torch_compiled_processes.py). Where
    torch cannot compile a step over processes (BatchNormalization's summed moments, a
    user's metric's gathered update) every process runs it eagerly alike, with the same
    numbers."""
    # torch's compiler takes seconds per program on a CPU, many more beside the suite's
    # other backends (over 300 s for the two processes once): compiling has its own limit,
    # the two runs' together under pytest's own (faulthandler_timeout, 1200 s), which
    # otherwise ends the whole torch run, not this test.
    # One compile thread: no pool of compile workers beside the suite's other backends.
    threads = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    one = _run(
        [sys.executable, COMPILED_SCRIPT, str(tmp_path / "one")], timeout=COMPILE_S, **threads
    )
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, COMPILED_SCRIPT, str(tmp_path / "two")], timeout=COMPILE_S, **threads)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one, first, second = (
        dict(np.load(tmp_path / f"{name}.npz")) for name in ("one-0", "two-0", "two-1")
    )
    for key in one:
        if key.startswith("runs/"):
            continue
        if key in second:
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    # 4 calls' steps (2 fits, their validation, evaluate): each call's first step of a kind
    # runs eagerly, the others compiled, in one process and in two alike.
    assert int(first["runs/dense"]) == int(second["runs/dense"]) == int(one["runs/dense"]) > 20
    # BatchNormalization: one process compiles both steps, two only the test step.
    assert int(second["runs/batchnorm"]) == int(first["runs/batchnorm"])
    assert 0 < int(first["runs/batchnorm"]) < int(one["runs/batchnorm"])
    # A user's metric, gathered from every process: neither step compiles over processes.
    assert int(second["runs/users_metric"]) == int(first["runs/users_metric"])
    assert int(first["runs/users_metric"]) < int(one["runs/users_metric"])


PRECISION_SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_precision.py")


def test_float16_loss_scaling_decides_alike_in_every_process(tmp_path):
    """Under "float16" (Keras's LossScaleOptimizer) both processes hold the same weights,
    bit for bit: the skip-or-apply decision reads the averaged gradients. Against one
    process, float16's own rounding in another order: measured 1.3e-4 on the weights' sum,
    so 2e-3."""
    one = _run([sys.executable, PRECISION_SCRIPT, "float16", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, PRECISION_SCRIPT, "float16", str(tmp_path / "two")])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    loaded = [dict(np.load(tmp_path / f"{n}.npz")) for n in ("one-0", "two-0", "two-1")]
    reference, first, second = loaded
    assert str(first["optimizer"]) == "LossScaleOptimizer"
    for key in first:
        if key != "optimizer":
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
            np.testing.assert_allclose(first[key], reference[key], atol=2e-3, err_msg=key)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOIN = "from keras_accel import Accelerator; Accelerator()"


def test_a_rank_that_never_joins_fails_within_the_timeout():
    started = time.monotonic()
    result = _run(
        [sys.executable, "-c", JOIN],
        WORLD_SIZE="2",
        RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        KERAS_ACCEL_HEARTBEAT_TIMEOUT="5",
    )
    assert result.returncode != 0
    assert "waited 5 s for all 2 processes to join" in result.stderr
    assert time.monotonic() - started < 120


def test_a_port_in_use_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(
            [sys.executable, "-c", JOIN],
            WORLD_SIZE="2",
            RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            KERAS_ACCEL_HEARTBEAT_TIMEOUT="30",
        )
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "in use by another program" in result.stderr


def test_a_bad_world_size_is_named():
    result = _run([sys.executable, "-c", JOIN], WORLD_SIZE="2", RANK="2")
    assert result.returncode != 0
    assert "needs this process's RANK in [0, 2). Received: RANK='2'" in result.stderr


def _model(acc):
    with acc.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    return model


def test_one_process_runs_n_steps_per_call_with_one_step_numbers():
    """Keras 3.15's torch trainer refuses steps_per_execution > 1; in one process the
    Accelerator runs N steps per host call, and fit, evaluate and predict give what one step
    per call gives (plain Keras), also for a last group shorter than N."""
    from keras_accel import Accelerator

    x = np.random.RandomState(0).randn(40, 4).astype("float32")
    y = np.random.RandomState(1).randn(40, 2).astype("float32")
    results = {}
    for n in (1, 4, "auto"):
        acc = Accelerator(seed=0, steps_per_execution=n)
        assert (acc.strategy_name, acc.num_replicas, acc.num_processes) == ("single", 1, 1)
        keras.utils.set_random_seed(0)
        model = _model(acc)
        batches = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs, seen=batches: seen.append(batch)
        )
        # 10 batches of 4: groups of 4, 4 and 2 at N=4.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = acc.fit(model, x, y, batch_size=4, epochs=2, verbose=0, callbacks=[record])
            results[n] = (
                history.history["loss"],
                acc.evaluate(model, x, y, batch_size=4, verbose=0),
                acc.predict(model, x, batch_size=4, verbose=0),
                model.get_weights(),
            )
        # A last group shorter than N is no "ran out of data" (Keras's iterator's words).
        assert not [w for w in caught if "ran out of data" in str(w.message)]
        assert model.steps_per_execution == 1  # The user's value is back.
        if n == 4:
            # Batch hooks fire once per group, numbered as Keras numbers a group's end.
            assert batches == [3, 7, 11] * 2
    for n in (4, "auto"):
        np.testing.assert_array_equal(results[n][0], results[1][0])
        assert results[n][1] == results[1][1]
        np.testing.assert_array_equal(results[n][2], results[1][2])
        assert results[n][2].shape == (40, 2)
        for a, b in zip(results[n][3], results[1][3]):
            np.testing.assert_array_equal(a, b)


def test_data_parallel_needs_one_process_per_device():
    from keras_accel import Accelerator

    with pytest.raises(ValueError, match="devices=2 but 1 cpu devices exist"):
        Accelerator(strategy="data_parallel", devices=2)


EXACT_SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_exact.py")


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory):
    """One launch of 2 processes and one process, for every check of users' metrics and
    per-row randomness (tests/adapter/_torch_exact.py)."""
    work = tmp_path_factory.mktemp("torch-exact")
    one = _run([sys.executable, EXACT_SCRIPT, str(work / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, EXACT_SCRIPT, str(work / "two")])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    return [dict(np.load(work / f"{name}.npz")) for name in ("one-0", "two-0", "two-1")]


@pytest.mark.parametrize("path", ("fit", "evaluate", "loop", "loop_evaluate", "custom_step"))
def test_users_metrics_are_the_global_batchs_in_every_process(exact_runs, path):
    """A running maximum kept in a "sum" variable, and a row count whose result() is its
    variable: each process reported its own rows before (24 and 21 rows where one process
    counts 45; the maxima summed), the chief logging a wrong number. Also where a model's
    own test_step updates them."""
    one, first, second = exact_runs
    names = ("peak", "rows") if path == "custom_step" else ("running_max", "rows", "loss")
    for name in names:
        key = f"{path}/{name}"
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    np.testing.assert_array_equal(first[f"{path}/rows"], 45.0)


@pytest.mark.parametrize("path", ("fit", "loop"))
def test_dropout_draws_the_global_batchs_mask(exact_runs, path):
    """Dropout(0.3, seed=5), GaussianNoise and an unseeded Dropout, 2 epochs on 45 rows in
    batches of 8: the weights of 2 processes are those of one process on the global batch
    (with process 1 drawing process 0's mask they differed by 0.09)."""
    one, first, second = exact_runs
    keys = [k for k in one if k.startswith(f"{path}/w")]
    assert len(keys) == 4
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)


def test_batchnorm_moments_are_the_global_batchs_on_data_far_from_zero(exact_runs):
    """keras-io's timeseries classifier on series of mean 100 and spread 1, 2 epochs of 45 rows
    in batches of 8: two processes train as one. The variance is the mean of squared
    deviations from the global mean (the mean first, then a second sum across processes);
    taken as E[x^2] - E[x]^2 from the processes' sums it depended on their order (weights
    6.6e-4 apart, 12 times this tolerance; now 0.03 of it). One process of plain Keras takes
    E[x^2] - E[x]^2 on torch, and its own rounding with it: no process count matches that
    (docs/accelerator.md)."""
    one, first, second = exact_runs
    keys = [k for k in one if k.startswith("batchnorm/")]
    assert len(keys) == 13  # The loss and 12 weights.
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=3e-5, atol=3e-5, err_msg=key)


@pytest.mark.parametrize(
    "make",
    (
        lambda: keras.layers.Dropout(0.3, seed=5),
        lambda: keras.layers.SpatialDropout1D(0.5, seed=3),
        lambda: keras.layers.GaussianNoise(0.5, seed=2),
        lambda: keras.layers.GaussianDropout(0.4, seed=4),
        lambda: keras.layers.AlphaDropout(0.3, seed=6),
    ),
)
def test_a_process_draws_its_rows_of_the_global_batchs_numbers(make):
    """Process 1 of 3 (rows 4..7 of 12), in this one process: its rows of the global batch's
    outputs, its gradient those rows' gradient, and the seed generator advanced once, as
    one process on the global batch."""
    import torch

    from keras_accel.adapter.backends.torch import rows as torch_rows
    from keras_accel.adapter.patches import Patches

    x = np.random.default_rng(0).normal(size=(12, 6, 5)).astype("float32")
    reference, layer = make(), make()
    whole = torch.tensor(x, requires_grad=True)
    expected = reference(whole, training=True)
    expected.sum().backward()
    model = keras.Sequential([keras.Input((6, 5)), layer])
    with Patches() as patches:
        assert torch_rows.GlobalRowDraws(world=3, rank=1).install(patches, model) == 1
        rows = torch.tensor(x[4:8], requires_grad=True)
        got = layer(rows, training=True)
        got.sum().backward()
        np.testing.assert_array_equal(layer(x[4:8], training=False), x[4:8])
    assert "call" not in vars(layer)  # Undone with the call.
    np.testing.assert_array_equal(got.detach().numpy(), expected.detach().numpy()[4:8])
    np.testing.assert_array_equal(rows.grad.numpy(), whole.grad.numpy()[4:8])
    assert not np.array_equal(got.detach().numpy(), expected.detach().numpy()[:4])
    states = [keras.ops.convert_to_numpy(v) for v in (reference.variables + layer.variables)]
    assert len(states) == 2 and np.array_equal(*states)  # The seed generators' states.


def test_a_layer_that_draws_nothing_is_left_alone():
    from keras_accel.adapter.backends.torch import rows as torch_rows
    from keras_accel.adapter.patches import Patches

    layers = [keras.layers.Dropout(0.0), keras.layers.GaussianNoise(0.0), keras.layers.Dropout(0.1)]
    model = keras.Sequential([keras.Input((4,)), *layers])
    with Patches() as patches:
        assert torch_rows.GlobalRowDraws(world=2, rank=0).install(patches, model) == 1
        assert [("call" in vars(layer)) for layer in layers] == [False, False, True]


def test_a_users_metric_updated_with_a_batch_value_is_refused_by_name():
    from keras_accel.adapter.backends import global_rows
    from keras_accel.adapter.backends.torch import rows as torch_rows

    class BatchMax(keras.metrics.Metric):
        def update_state(self, value):
            pass

        def result(self):
            return 0.0

    metric = BatchMax(name="batch_max")
    assert list(global_rows.user_metrics([keras.metrics.Mean(), metric])) == [metric]
    with pytest.raises(ValueError, match=r"'batch_max' \(BatchMax\) was updated with a scalar"):
        torch_rows.RowGather().rows(metric, ((keras.ops.convert_to_tensor(1.0),), {}))
    with pytest.raises(ValueError, match=r"different first dimensions \[\(4, 3\), \(3,\)\]"):
        torch_rows.RowGather().rows(metric, ((keras.ops.ones((4, 3)), keras.ops.ones(3)), {}))
