"""Every example runs as written (with small sizes), the way the docs tell users to run it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PYTHON = sys.executable


def run(*args: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [PYTHON, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_demo_prints_a_row_per_reducer_beside_single_device():
    out = run("examples/demo.py", "--epochs", "2")
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == [
        "single device",
        "one_device",
        "hierarchical_copy",
        "auto -> hierarchical_copy",
        "horovod (2 processes)",
        "ring (2 processes)",
    ]
    assert [int(row.split("|")[2]) for row in rows] == [1, 2, 2, 2, 2, 2]
    for row in rows[1:]:
        assert float(row.split("|")[-2]) < 1e-4, row  # max weight difference to single device
    # The job's processes (TF_CPP_MIN_LOG_LEVEL=3) print none of TensorFlow's start-up lines.
    startup = ("cudart_stub", "oneDNN custom operations", "cuInit", "absl::InitializeLog")
    assert not [line for line in out.splitlines() if any(s in line for s in startup)]


#: TensorFlow's start-up lines as its processes print them, and a line of the script's own.
LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "I0000 00:00:1796581301.159329   15464 port.cc:153] oneDNN custom operations are on.\n",
    "W0000 00:00:1796581301.160005   15464 cudart_stub.cc:31] Could not find cuda drivers\n",
    "E0000 00:00:1796581291.411946   15216 cuda_platform.cc:52] failed call to cuInit\n",
    "I0000 is the script's own line\n",
]


def test_the_launcher_shows_tensorflows_lines_at_the_log_level_each_process_asks_for():
    from kmirror._core.launching import supervisor

    shown = {level: [supervisor.shown(line, level) for line in LINES] for level in range(4)}
    assert shown == {
        0: [True, True, True, True, True],
        1: [True, False, True, True, True],
        2: [False, False, False, True, True],
        3: [False, False, False, False, True],
    }


def test_horovod_example_under_the_launcher():
    out = run(
        "-m",
        "kmirror.launch",
        "-n",
        "2",
        "--timeout",
        "240",
        "examples/horovod_digits.py",
        "--epochs",
        "1",
    )
    checksums = {line.split("checksum")[-1] for line in out.splitlines() if "checksum" in line}
    assert len(checksums) == 1 and "rank 0 of 2" in out and "rank 1 of 2" in out


def test_checkpoint_example_crashes_and_resumes(tmp_path):
    out = tmp_path / "run"
    crashed = subprocess.run(
        [
            PYTHON,
            "examples/checkpoint_resume.py",
            "--out",
            str(out),
            "--epochs",
            "4",
            "--crash-at-epoch",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert crashed.returncode == -9 and "simulating a crash in epoch 3" in crashed.stdout
    resumed = run("examples/checkpoint_resume.py", "--out", str(out), "--epochs", "4")
    assert "trained epochs 3..4 of 4" in resumed
    assert (out / "best.keras").exists() and not (out / "backup").exists()


def test_multi_worker_example_under_the_launcher():
    out = run(
        "-m",
        "kmirror.launch",
        "--workers",
        "2",
        "--timeout",
        "240",
        "examples/multi_worker_digits.py",
        "--epochs",
        "1",
    )
    checksums = {line.split("checksum")[-1] for line in out.splitlines() if "checksum" in line}
    assert len(checksums) == 1 and "chief of 2 replicas" in out and "worker of 2 replicas" in out


def test_gan_example_trains_as_on_one_device():
    out = run("examples/gan_digits.py", "--epochs", "2")
    difference = float(out.strip().splitlines()[-1].split(":")[-1])
    assert difference < 1e-4
    rows = [line for line in out.splitlines() if line.startswith("| ") and "epoch" not in line]
    assert len(rows) == 2
    for row in rows:
        d_single, d_wrapped, g_single, g_wrapped = map(float, row.split("|")[2:6])
        assert abs(d_single - d_wrapped) < 1e-4 * abs(d_single)
        assert abs(g_single - g_wrapped) < 1e-4 * abs(g_single)
