"""`strategy="model_parallel"` on torch: 2 processes (`keras-accel launch -n 2`), a
`keras.distribution.LayoutMap` splitting two kernels over the processes ("model"), each
process running the whole batch: fit (Adam, BatchNormalization, Dropout, validation on 37
rows in batches of 8, the last padded), evaluate and predict equal each process alone
(strategy="single") bit for bit, each process holding half of what the map splits; what
it names but cannot split is said, an entry that matches no variable refused; and
BackupAndRestore resumes a stopped fit bit for bit over 2 processes, 1 -> 2 and 2 -> 1
(tests/adapter/_torch_model_parallel.py; the one-process parts in the test's process)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from keras_accel import Accelerator
from tests.conftest import BACKEND

pytestmark = pytest.mark.torch

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_model_parallel.py")


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    if BACKEND != "torch":
        pytest.skip("torch's processes")
    from tests.adapter import _torch_model_parallel as script

    work = tmp_path_factory.mktemp("torch-model-parallel")
    # One process's backup (here, in the test's process) for the two to resume from.
    script.stopped("single", None, str(work / "one.backup"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2", SCRIPT]
    run = subprocess.run(
        [*command, str(work / "two")], env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saved = [dict(np.load(work / f"two-{index}.npz")) for index in (0, 1)]
    # The two processes' backup resumed in one process (strategy="single").
    two_to_one = script.resumed("single", None, str(work / "backup.kept"))
    saved[0].update({f"two_to_one/{k}": v for k, v in two_to_one.items()})
    return saved, run.stdout + run.stderr


def test_two_model_parallel_processes_train_evaluate_and_predict_as_one(processes):
    processes, _ = processes
    for saved in processes:
        keys = [k[len("one/") :] for k in saved if k.startswith("one/") and "/held/" not in k]
        keys = [k for k in keys if not k.startswith("held/") and k != "class"]
        assert {"history/loss", "history/val_mae", "evaluate", "predict"} <= set(keys)
        assert any(k.startswith("var/adam/") for k in keys)
        assert saved["ours/predict"].shape == (37, 3)  # Every row, in order.
        for key in keys:
            np.testing.assert_array_equal(saved[f"ours/{key}"], saved[f"one/{key}"], err_msg=key)
    losses = processes[0]["one/history/loss"]
    assert abs(losses[0] - losses[1]) > 1e-3  # It trained.


def test_each_process_holds_half_of_what_the_layout_map_splits(processes):
    processes, output = processes
    saved = processes[0]
    held = {k[len("ours/held/") :]: tuple(saved[k]) for k in saved if k.startswith("ours/held/")}
    whole = {k[len("one/held/") :]: tuple(saved[k]) for k in saved if k.startswith("one/held/")}
    assert held.keys() == whole.keys()
    split = {
        "net/first/kernel": (6, 4),  # (None, "model"): its columns.
        "net/last/kernel": (4, 3),  # ("model", None): its rows.
        "adam/net_first_kernel_momentum": (6, 4),  # A slot as its variable.
        "adam/net_first_kernel_velocity": (6, 4),
        "adam/net_last_kernel_momentum": (4, 3),
        "adam/net_last_kernel_velocity": (4, 3),
    }
    for path, shape in whole.items():
        # What the map names not, and its (3,) bias that 2 does not divide: whole.
        assert held[path] == split.get(path, shape), path
    for path in held:
        assert tuple(processes[1][f"ours/held/{path}"]) == held[path]
    assert str(saved["ours/class"]) == "Variable"  # Keras's own variables after the call.
    # The one the map names but 2 does not divide: said by the chief, once per model (4
    # models: the fit above, the stopped one, the two resumed ones).
    note = "model_parallel keeps 1 weight(s) its LayoutMap names whole"
    assert output.count(note) == 4 and "net/last/bias (3,)." in output, output[-3000:]


@pytest.mark.parametrize(
    "process, run",
    [(0, "resumed"), (1, "resumed"), (0, "one_to_two"), (1, "one_to_two"), (0, "two_to_one")],
    ids=["2-to-2", "2-to-2-second", "1-to-2", "1-to-2-second", "2-to-1"],
)
def test_a_stopped_model_parallel_fit_resumes_exactly_on_any_process_count(processes, process, run):
    """BackupAndRestore: each process writes its shards; the fit stopped after step 8 and
    resumed from step 6's backup (mid-epoch), over 2 processes, from one process's backup
    over 2, and from the 2 processes' backup in one, ends as the uninterrupted one, bit for
    bit (every process runs the whole batch: the same numbers as one process)."""
    processes, _ = processes
    saved = processes[process]
    keys = [k[len(run) + 1 :] for k in saved if k.startswith(f"{run}/")]
    assert "history/loss" in keys and any(k.startswith("var/adam/") for k in keys)
    assert len(saved[f"{run}/history/loss"]) == 1  # Only epoch 1 ran again.
    for key in keys:
        want = saved[f"ours/{key}"]
        want = want[-1:] if key.startswith("history/") else want
        np.testing.assert_array_equal(saved[f"{run}/{key}"], want, err_msg=key)


def test_a_layout_map_entry_that_matches_no_variable_is_named(processes):
    processes, _ = processes
    for saved in processes:
        message = str(saved["typo"])
        assert "the LayoutMap's entries ['net/frist/kernel'] match no variable" in message
        assert "Its variables: net/first/kernel, net/first/bias" in message


def test_a_keras_hub_class_lays_its_backbone_out_by_its_own_map(processes):
    """`layout_map=keras_hub.models.GemmaCausalLM`: the map `GemmaBackbone.get_layout_map`
    ships, for a mesh of the processes (its "model" entries split, as on JAX); a tiny Gemma
    under it trains and evaluates as each process alone, bit for bit, each process holding
    half of what the map splits and its Adam slots."""
    processes, _ = processes
    saved = processes[0]
    if not any(key.startswith("hub/") for key in saved):
        pytest.skip("keras_hub is not installed")
    keys = [k[len("hub/one/") :] for k in saved if k.startswith("hub/one/") and "/held/" not in k]
    assert "history/loss" in keys and "var/token_embedding/embeddings" in keys
    for process in processes:
        for key in keys:
            np.testing.assert_array_equal(
                process[f"hub/ours/{key}"], saved[f"hub/one/{key}"], err_msg=key
            )
    held = {k[len("hub/ours/held/") :]: tuple(saved[k]) for k in saved if "hub/ours/held/" in k}
    split = {
        "token_embedding/embeddings": (32, 16),  # ("model", "batch"): the vocabulary.
        "decoder_block_0/attention/query/kernel": (2, 16, 8),  # ("model", "batch", None)
        "decoder_block_0/attention/attention_output/kernel": (2, 8, 16),
        # Gemma's feed-forward is intermediate_dim / 2 = 16 wide.
        "decoder_block_0/ffw_gating/kernel": (16, 8),  # ("batch", "model")
        "decoder_block_0/ffw_linear/kernel": (8, 16),  # ("model", "batch")
        "adam/token_embedding_embeddings_momentum": (32, 16),  # A slot as its variable.
        "adam/decoder_block_0_ffw_gating_kernel_velocity": (16, 8),
        "head/kernel": (16, 3),  # What the map names not: whole.
        "decoder_block_0/pre_attention_norm/scale": (16,),
    }
    for path, shape in split.items():
        assert held[path] == shape, (path, held[path])


@pytest.mark.skipif(BACKEND != "torch", reason="torch's builder")
def test_model_parallel_on_torch_asks_for_a_layout_map():
    with pytest.raises(
        ValueError, match=r"LayoutMap names over the processes .*Received: layout_map=None"
    ):
        Accelerator(strategy="model_parallel")
