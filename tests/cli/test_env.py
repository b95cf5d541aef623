"""`keras-accel env`: what runs here, as a console script and as a function."""

import os
import subprocess
import sys

from keras_accel.cli.main import env_report, main
from tests.cli._shims import pythonpath_without_torch


def test_env_report_names_backend_devices_and_auto_choice(backend, num_devices):
    report = env_report()
    assert f"KERAS_BACKEND: {backend}" in report
    assert "keras 3." in report and "keras_accel 0.1.0" in report
    assert f"auto strategy: data_parallel with {num_devices} replica(s)" in report
    assert "cpu:0" in report and f"cpu:{num_devices - 1}" in report


def test_console_script_with_virtual_devices(backend):
    env = dict(os.environ, KERAS_BACKEND=backend)
    result = subprocess.run(
        [sys.executable, "-m", "keras_accel.cli.main", "env", "--virtual-devices", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "auto strategy: data_parallel with 4 replica(s)" in result.stdout
    assert "processes: 1 (this is process 0, the chief)" in result.stdout


def test_bad_virtual_device_count_is_a_clean_error(capsys):
    assert main(["env", "--virtual-devices", "0"]) == 2
    assert "Received: count=0" in capsys.readouterr().err


def _env_in_subprocess(tmp_path, backend, keras_json=None, set_backend=False):
    home = tmp_path / "keras_home"
    home.mkdir()
    if keras_json is not None:
        (home / "keras.json").write_text(keras_json)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(home)
    if set_backend:
        env["KERAS_BACKEND"] = backend
    result = subprocess.run(
        [sys.executable, "-m", "keras_accel.cli.main", "env"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return next(line for line in result.stdout.splitlines() if line.startswith("KERAS_BACKEND"))


def test_env_says_where_the_backend_came_from(tmp_path, backend):
    # keras.json chose it: env names the file, not "default".
    line = _env_in_subprocess(tmp_path, backend, keras_json=f'{{"backend": "{backend}"}}')
    config = tmp_path / "keras_home" / "keras.json"
    assert line == f"KERAS_BACKEND: {backend} (from {config}; set KERAS_BACKEND to override)"
    # The variable wins over a keras.json that names the other backend.
    other = "tensorflow" if backend == "jax" else "jax"
    (tmp_path / "keras_home").rename(tmp_path / "old")
    line = _env_in_subprocess(
        tmp_path, backend, keras_json=f'{{"backend": "{other}"}}', set_backend=True
    )
    assert line == f"KERAS_BACKEND: {backend} (from the KERAS_BACKEND environment variable)"


def test_a_backend_whose_package_is_missing_is_one_line_not_a_traceback(tmp_path, backend):
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        KERAS_HOME=str(tmp_path),
        PYTHONPATH=pythonpath_without_torch(tmp_path),
    )
    result = subprocess.run(
        [sys.executable, "-m", "keras_accel.cli.main", "env"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("keras-accel env: error: the Keras backend 'torch' (from the ")
    assert "needs torch, which is not installed" in lines[0]
    assert 'pip install -c constraints.txt -e ".[torch]"' in lines[0]
    installed = lines[0].split("or set KERAS_BACKEND to an installed backend (")[1]
    assert backend in installed.split(")")[0].split(", ")
