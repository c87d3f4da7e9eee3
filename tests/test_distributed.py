"""Many hosts: two processes under ``jax.distributed`` train an O2 float16 FSDP step with
``mpjax.loss_scale`` and skip an overflowing step together (tests/distributed_worker.py)."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).resolve().parent / "distributed_worker.py"
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_skip_an_overflow_in_one_process_half_together(tmp_path):
    import distributed_worker as w

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            logs.append(out)
    finally:
        for p in procs:  # only the processes this test started, by their pids
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)[-6000:]
    runs = [np.load(tmp_path / f"{i}.npz") for i in range(2)]
    for i in range(w.STEPS):
        skipped = i == w.POISONED_STEP
        for run in runs:
            assert bool(run[f"finite_{i}"]) is not skipped  # both processes saw the overflow
            assert int(run[f"skipped_{i}"]) == (1 if i >= w.POISONED_STEP else 0)
        for name in ("w1", "b1", "w2"):
            a, b = runs[0][f"{name}_{i}"], runs[1][f"{name}_{i}"]
            assert np.array_equal(a, b), (name, i)  # identical params, bit for bit
            if skipped:  # the step changed nothing, and the scale halved
                assert np.array_equal(a, runs[0][f"{name}_{i - 1}"]), name
            elif i:
                assert not np.array_equal(a, runs[0][f"{name}_{i - 1}"]), name
    scales = [float(runs[0][f"scale_{i}"]) for i in range(w.STEPS)]
    assert scales[w.POISONED_STEP] == scales[w.POISONED_STEP - 1] / 2
    assert [float(runs[1][f"scale_{i}"]) for i in range(w.STEPS)] == scales
