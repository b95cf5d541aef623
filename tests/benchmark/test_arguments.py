"""Bad input is refused before any child process starts, saying what would work."""

import sys

import pytest

from keras_accel.benchmark import BenchInputError, run_benchmark
from keras_accel.benchmark.cli import QUICK_DEFAULTS, resolve
from keras_accel.benchmark.spec import model_reference, parse_backends, parse_batch_sizes
from keras_accel.cli.main import build_parser, main


def _usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _error(capsys, *argv):
    assert main(["bench", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_unknown_model_lists_the_valid_ones(capsys):
    err = _usage_error(capsys, "--model", "resnet")
    assert "Unknown model. Received: model='resnet'. Valid models: mlp, cnn, bert" in err
    with pytest.raises(BenchInputError, match="Valid models: mlp, cnn, bert"):
        run_benchmark("vgg", [32])


def test_model_function_must_be_importable():
    assert model_reference("tests.benchmark.tiny_models:wide_conv").endswith(":wide_conv")

    def local():
        return None

    with pytest.raises(BenchInputError, match="top level of an importable module"):
        model_reference(local)
    with pytest.raises(BenchInputError, match="top level"):
        model_reference(lambda: None)


@pytest.mark.parametrize("text", ["0", "256,-1", "abc", "1.5", "256,,1024", ""])
def test_batch_sizes_must_be_positive_integers(capsys, text):
    err = _usage_error(capsys, "--batch-sizes", text)
    assert "Batch sizes must be positive integers" in err or "at least one" in err
    assert repr(text) in err


def test_batch_sizes_parse_and_deduplicate():
    assert parse_batch_sizes(" 256,1024 ,256") == (256, 1024)
    assert parse_batch_sizes([64, 128]) == (64, 128)
    with pytest.raises(BenchInputError, match="True"):
        parse_batch_sizes([True])


def test_unknown_backend_lists_the_valid_ones(capsys):
    err = _usage_error(capsys, "--backends", "jax,mxnet")
    assert "Unknown backend. Received: 'mxnet'" in err
    assert "Valid backends: jax, tensorflow, torch" in err
    assert parse_backends("jax, tensorflow,jax") == ("jax", "tensorflow")


def test_more_samples_than_any_data_set(capsys):
    err = _error(capsys, "--samples", "300000", "--batch-sizes", "256")
    assert "Asked for 300000 samples; real CIFAR-10 has 50000 training images" in err
    assert "synthetic data is capped at 200000" in err


def test_batch_larger_than_the_data(capsys):
    err = _error(capsys, "--samples", "512", "--batch-sizes", "256,1024")
    assert "Batch sizes [1024] are larger than samples=512" in err


def test_other_bad_values(capsys):
    assert "must be a positive integer. Received: '0'" in _usage_error(capsys, "--epochs", "0")
    assert "invalid choice: 'int8'" in _usage_error(capsys, "--mixed-precision", "int8")
    err = _error(capsys, "--strategy", "fastest", "--batch-sizes", "64", "--samples", "64")
    assert "Unknown strategy. Received: strategy='fastest'. Valid names: auto" in err


def test_plot_without_matplotlib_fails_before_running(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    err = _error(capsys, "--batch-sizes", "64", "--samples", "64", "--plot",
                 str(tmp_path / "p.png"))  # fmt: skip
    assert "--plot needs matplotlib" in err and "pip install keras-accel[plot]" in err


def test_quick_defaults_and_explicit_options_win():
    args = build_parser().parse_args(["bench", "--quick", "--epochs", "2"])
    settings = resolve(args)
    assert settings["epochs"] == 2
    assert settings["backends"] == QUICK_DEFAULTS["backends"] == ("jax", "tensorflow")
    assert settings["model"] == "mlp" and len(settings["batch_sizes"]) in (2, 3)
    full = resolve(build_parser().parse_args(["bench"]))
    assert full["batch_sizes"] == (256, 1024, 4096, 8192, 16384, 50000)
    assert full["samples"] == 50000
