"""`keras-accel env`: what runs here, as a console script and as a function."""

import os
import subprocess
import sys

from keras_accel.cli.main import env_report, main


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
