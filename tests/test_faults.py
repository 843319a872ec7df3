"""Faults: a NaN on one replica's rows stops every process at the same step; the launcher's ports.

Every case is bounded by a timeout. (The other fault cases live beside the features they break:
a killed rank or worker in test_horovod.py / test_multi_worker.py, a process killed while writing a
checkpoint and a relaunch with BackupAndRestore in test_callbacks.py; docs/reliability.md lists
them all.)
"""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cpus
from models import NAN_BATCH as BATCH
from models import dense_model, max_weight_difference, nan_data

import kmirror

HERE = Path(__file__).parent
TIMEOUT = 240
#: The first port the kernel hands out for port 0 and outgoing connections (Linux).
EPHEMERAL = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_nan_on_one_replicas_rows_stops_training_at_that_step_before_its_update():
    x, y = nan_data()
    model = kmirror.wrap(dense_model("sgd"), "hierarchical_copy", devices=cpus(2))
    with pytest.raises(
        kmirror.errors.NonFiniteLoss, match="became NaN or infinite at epoch 1, batch 3"
    ):
        model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2, "stopped at the step it happened"
    reference = dense_model("sgd")
    reference.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-6, "the weights of the last finite step"


NAN_JOB = """
import sys
import time
import numpy as np
import kmirror
from models import NAN_BATCH as BATCH
from models import dense_model, nan_data
x, y = nan_data()
model = kmirror.wrap(dense_model("sgd"), reducer={reducer!r})
try:
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
except kmirror.errors.NonFiniteLoss as error:
    print("STOPPED after", int(model.optimizer.iterations.numpy()), "steps:", error, flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("mode, reducer", [("horovod", "horovod"), ("ring", "ring")])
def test_nan_on_one_ranks_rows_stops_every_process_together(mode, reducer, tmp_path):
    script = tmp_path / "nan_job.py"
    header = f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport lean_start\n"
    if mode == "ring":
        header += "import kmirror\nkmirror.cluster.connect()\n"
    script.write_text(header + NAN_JOB.format(reducer=reducer))
    launcher = [sys.executable, "-m", "kmirror.launch", "-n", "2", "--mode", mode]
    done = subprocess.run(
        [*launcher, "--timeout", "180", str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert (
            f"[{rank}] STOPPED after 2 steps: kmirror: the training loss became NaN or infinite "
            "at epoch 1, batch 3" in done.stdout
        )


def occupied_port():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


@pytest.mark.parametrize("mode", ["horovod", "ring"])
def test_a_port_in_use_is_named_and_a_free_one_is_picked_otherwise(mode):
    holder, port = occupied_port()
    show = [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]
    with holder:
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            kmirror.launch.launch(show, n=2, mode=mode, port=port, timeout=60)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kmirror.launch",
                "-n",
                "2",
                "--mode",
                mode,
                "--port",
                str(port),
                "--timeout",
                "60",
                *show,
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert done.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in done.stderr
        # Without a port the launcher picks free ones, on loopback only.
        code, lines = run_capturing(show, mode)
    assert code == 0
    environments = [json.loads(line.split("] ", 1)[1]) for line in lines]
    assert len(environments) == 2
    for environment in environments:
        if mode == "horovod":
            assert environment["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
            assert int(environment["HOROVOD_GLOO_RENDEZVOUS_PORT"]) != port
        else:
            workers = json.loads(environment["TF_CONFIG"])["cluster"]["worker"]
            assert all(w.startswith("127.0.0.1:") for w in workers)
            ports = [int(w.split(":")[1]) for w in workers]
            assert port not in ports
            # below the ports the kernel hands out for port 0, which another program could take
            assert max(ports) < EPHEMERAL, (ports, EPHEMERAL)


def run_capturing(command, mode):
    import io

    output = io.StringIO()
    code = kmirror.launch.launch(command, n=2, mode=mode, timeout=60, output=output)
    return code, [line for line in output.getvalue().splitlines() if line.endswith("}")]


RESTARTED = """
import json, os, sys, time
from pathlib import Path

rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
folder = Path(sys.argv[1])
runs = folder / f"runs-{rank}"
runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
if rank == 1 and not (folder / "failed").exists():
    (folder / "failed").touch()
    for _ in range(200):  # fails once rank 0 has counted its run
        if (folder / "runs-0").exists():
            break
        time.sleep(0.05)
    sys.exit(3)
"""


def test_a_failed_job_is_started_again_up_to_max_restarts(tmp_path):
    """Rank 1 fails at the job's first start: with max_restarts=1 the whole job is started again
    (both ranks) and succeeds; with max_restarts=0 the launcher returns the failure."""
    import io

    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    for restarts, expected in ((0, 3), (1, 0)):
        folder = tmp_path / f"restarts-{restarts}"
        folder.mkdir()
        output = io.StringIO()
        code = kmirror.launch.launch(
            [sys.executable, str(script), str(folder)],
            n=2,
            mode="ring",
            timeout=60,
            output=output,
            max_restarts=restarts,
        )
        assert code == expected, output.getvalue()
        runs = [int((folder / f"runs-{rank}").read_text()) for rank in (0, 1)]
        assert runs == [1 + restarts] * 2, "every rank starts again"
        assert output.getvalue().count("starting it again") == restarts


PREEMPTED = """
import json, os, signal, sys, time
from pathlib import Path

rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
folder = Path(sys.argv[1])


def stop(signum, frame):
    (folder / f"terminated-{rank}").touch()
    sys.exit(75)  # as a process that backed up on SIGTERM


signal.signal(signal.SIGTERM, stop)
(folder / f"up-{rank}").touch()
time.sleep(60)
"""


def test_sigterm_to_the_launcher_reaches_every_process_and_the_job_is_not_started_again(
    tmp_path,
):
    script = tmp_path / "preempted.py"
    script.write_text(PREEMPTED)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kmirror.launch", "--workers", "2", "--max-restarts", "2"]
        + ["--timeout", "60", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(400):
            if all((tmp_path / f"up-{rank}").exists() for rank in (0, 1)):
                break
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == kmirror.callbacks.EXIT_PREEMPTED, output
    assert "SIGTERM: passing it on to every process" in output
    assert "starting it again" not in output
    assert all((tmp_path / f"terminated-{rank}").exists() for rank in (0, 1))
