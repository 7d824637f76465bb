"""Several processes, one mesh: jax.distributed start-up, the Ray launcher, failures.

Default run: argument checks, the launcher's one-line errors, a two-process check of the
host-side pieces (gathered prompts, batch placement, a rollout's host loop, the one-step-off
mode's split of each host's devices) against one process, and a failed host bringing a Ray
job down. Slow (`-m slow`): two PPO steps of the tiny config on 2 Ray processes x 4 CPU
devices equal the single-process 8-device run, and so does a third step after both resume
from their checkpoints, in the synchronous and in the one-step-off mode; a host that dies at
step 1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_run import MACHINE, ROOT, steps_logged, tiny, tiny_overrides

from rlhf_jax import distributed

LAUNCH = ROOT / "scripts/launch_ray.py"


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                                "RLHF_JAX_", "RAY_ADDRESS"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _launch(args: list[str], cwd: Path, timeout: float, **env) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(LAUNCH), *args], cwd=cwd, capture_output=True,
                         text=True, timeout=timeout, env=_env(**env))
    return out.returncode, out.stdout, out.stderr, time.perf_counter() - start


def _ray_worker_logs(since: float) -> str:
    """What the workers of the latest local Ray session wrote to their log files since
    `since`. The launcher's stdout holds Ray's forwarded copy, which can miss the last lines
    of a process that died: the job ends before the log monitor reads them."""
    logs = Path(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "session_latest", "logs")
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("worker-*"))
                   if p.stat().st_mtime >= since)


# ------------------------------------------------------------------------ initialize, errors


def test_initialize_checks_its_coordinates(monkeypatch):
    import jax

    jax.devices()  # backends are up in this process
    with pytest.raises(distributed.DistributedError, match=r"process_id 5 is not in \[0, 2\)"):
        distributed.initialize("localhost:1234", 2, 5)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(distributed.DistributedError, match="JAX_NUM_PROCESSES='two'"):
        distributed.initialize()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    with pytest.raises(distributed.DistributedError, match="before the first jax computation"):
        distributed.initialize("localhost:1234")
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    monkeypatch.delenv("JAX_PROCESS_ID")
    assert distributed.initialize() is False  # nothing asked, jax already running: one process


def test_cpu_device_count_replaces_the_inherited_one(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
    distributed.set_cpu_device_count(4)
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"


def test_one_process_is_left_alone():
    loader = object()
    assert distributed.gathered(loader) is loader and distributed.gathered(None) is None
    assert distributed.allgather_objects({"a": 1}) == [{"a": 1}]


def test_launcher_user_errors_are_one_line(tmp_path):
    cases = {
        "data.train_batch_size 15 is not a multiple of --num-hosts 2": [
            "--num-hosts", "2", "data.train_batch_size=15",
            "actor_rollout_ref.actor.ppo_mini_batch_size=5"],
        "unknown config key 'trainer.no_such_key'": ["--num-hosts", "2",
                                                     "trainer.no_such_key=1"],
        "--num-hosts must be >= 1": ["--num-hosts", "0"],
    }
    for needle, args in cases.items():
        code, _, err, _ = _launch(args, tmp_path, timeout=120)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (needle, err)
        assert needle in lines[0], (needle, lines[0])


# ---------------------------------------------------------------- two processes, host pieces


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _synthetic_data(tmp: Path) -> Path:
    from rlhf_jax.tasks.addition import prepare_files

    prepare_files(str(tmp / "train.parquet"), None, str(tmp / "model"), 32, 0, 0)
    return tmp


def test_two_processes_see_what_one_process_sees(tmp_path):
    """Gathered prompt shards, batch placement, collectives, host fetches: each of 2
    processes (4 devices, gloo) gets exactly the single 8-device process's arrays."""
    import multihost_check

    data = _synthetic_data(tmp_path)
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests/multihost_check.py"), str(data), str(tmp_path / "r")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
        for i in range(2)]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    single = multihost_check.compute(data)
    assert int(single["devices"]) == 8 and not single["rows_sharded_over_hosts"]
    np.testing.assert_array_equal(single["roundtrip"], np.arange(96).reshape(16, 6))
    # the one-step-off split: 4 train + 4 rollout devices here, 2 + 2 a host on 2 hosts
    np.testing.assert_array_equal(single["on_rollout_devices"], np.arange(96).reshape(16, 6))
    assert json.loads(str(single.pop("split"))) == {
        "per_host": False, "train_devices_by_process": [4], "rollout_devices_mine": True,
        "train_mesh": {"data": 2, "fsdp": 2, "tensor": 1},
        "rollout_mesh": {"data": 2, "fsdp": 1, "tensor": 2}}
    np.testing.assert_array_equal(single["joined_index"], np.repeat(np.arange(4), 2))
    np.testing.assert_array_equal(single["joined_slowest"], [0.5, 1.0])
    for i in range(2):
        got = dict(np.load(tmp_path / f"r.{i}.npz"))
        assert int(got.pop("process")) == i and int(got["devices"]) == 8
        assert got.pop("rows_sharded_over_hosts")  # so `fetch` really gathered across hosts
        assert json.loads(str(got.pop("objects"))) == [{"process": 0, "text": "xxx"},
                                                       {"process": 1, "text": "xxxx"}]
        assert json.loads(str(got.pop("split"))) == {
            "per_host": True, "train_devices_by_process": [2, 2], "rollout_devices_mine": True,
            "train_mesh": {"data": 2, "fsdp": 2, "tensor": 1},
            "rollout_mesh": {"data": 1, "fsdp": 1, "tensor": 2}}
        # the slowest host's generation and stage times
        np.testing.assert_array_equal(got.pop("joined_slowest"), [1.5, 2.0])
        assert got.keys() == single.keys() - {"rows_sharded_over_hosts", "objects",
                                              "joined_slowest"}
        for k, v in got.items():
            np.testing.assert_array_equal(v, single[k], err_msg=f"{k} process {i}")


# --------------------------------------------------------------------- the Ray launcher, jobs


def _hosts(tmp: Path, *extra: str) -> list[str]:
    return ["--num-hosts", "2", "--cpu-devices-per-host", "4", *tiny_overrides(tmp),
            "mesh=cpu-8", *extra]


def test_failed_host_brings_the_job_down(tmp_path):
    """Host 1 raises as soon as it has joined; host 0 waits at the trainer's first collective
    for ever. The launcher must kill it, print host 1's error on one line and exit 2, promptly."""
    code, out, err, seconds = _launch(_hosts(tmp_path), tmp_path, timeout=240,
                                      RLHF_JAX_TEST_FAULT="1:0:raise")
    assert code == 2, (out[-2000:], err[-2000:])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: host 1 of 2 failed: RuntimeError: injected fault: process 1 "
                      "fails at step 0"], err[-2000:]
    assert "placement SPREAD (a local cluster is one node" in out
    assert seconds < 200
    assert not (tmp_path / "run/metrics.jsonl").exists()  # host 0 never trained a step


@pytest.mark.slow
def test_host_dying_at_step_1_ends_the_job(tmp_path):
    started = time.time()
    code, out, err, seconds = _launch(
        _hosts(tmp_path, "trainer.sft_warmup.enable=false", "trainer.test_freq=-1"),
        tmp_path, timeout=900, RLHF_JAX_TEST_FAULT="1:1:exit")
    assert code == 2, (out[-2000:], err[-2000:])
    assert "injected fault: process 1 exits at step 1" in _ray_worker_logs(started)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: host 1 of 2 failed: its process died"), err[-2000:]
    # host 0 finished step 1 and was then killed while waiting for host 1 in step 2
    assert list(steps_logged(tmp_path / "run")) == [1]


# The critic makes one update a step (one epoch of one mini-batch), so its update makes the
# rollout's values, gathered from both hosts; the actor keeps its 4 updates a step.
CRITIC_ONE_UPDATE = {"critic.ppo_epochs": 1, "critic.ppo_mini_batch_size": 16}


@pytest.mark.slow
def test_two_hosts_match_one_host(tmp_path):
    """2 PPO steps of the tiny config: 2 Ray processes x 4 CPU devices on the global (2,2,2)
    mesh log the metrics of one 8-device process (algorithmic ones, within 1e-5)."""
    from rlhf_jax.trainer import train

    critic = [f"{k}={v}" for k, v in CRITIC_ONE_UPDATE.items()]
    code, out, err, _ = _launch(_hosts(tmp_path / "hosts", *critic), tmp_path, timeout=1500)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "launch_ray: host 0 finished (2 steps)" in out
    assert "launch_ray: host 1 finished (2 steps)" in out
    train(tiny(tmp_path / "one", mesh="cpu-8", **CRITIC_ONE_UPDATE))
    hosts, one = _same_steps(tmp_path, [1, 2])
    assert "timing_s/values" not in hosts[2] and hosts[2]["timing_s/update_critic"] > 0
    rows = (tmp_path / "hosts/run/metrics.jsonl").read_text().splitlines()
    assert len([r for r in rows if "event" not in json.loads(r)]) == 2  # process 0 logs alone
    assert "val-core/synthetic/addition/reward/mean@1" in hosts[2]
    # checkpoints: every process wrote its shards through orbax, and they restore here
    from rlhf_jax.checkpoint import Checkpointer

    with Checkpointer(tmp_path / "hosts/run/checkpoints") as ckpt:
        assert ckpt.latest_step() == 2
    assert (tmp_path / "hosts/run/checkpoints/2/rlhf_manifest.json").is_file()

    # Resume: the 2 hosts restore their step-2 checkpoint (each process its shards) and go
    # on to step 3, logging what the one process logs when it goes on from its own.
    more = {"trainer.total_training_steps": 3, "trainer.test_freq": -1}
    code, out, err, _ = _launch(_hosts(tmp_path / "hosts", *critic, *(
        f"{k}={v}" for k, v in more.items())), tmp_path, 1500)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "launch_ray: host 1 finished (3 steps)" in out  # its global step
    train(tiny(tmp_path / "one", mesh="cpu-8", **CRITIC_ONE_UPDATE, **more))
    _same_steps(tmp_path, [1, 2, 3])
    events = [json.loads(r) for r in
              (tmp_path / "hosts/run/metrics.jsonl").read_text().splitlines()]
    assert [e["from_step"] for e in events if e.get("event") == "training/resumed"] == [2]


# The one-step-off mode on the 4 + 4 split (meshes/cpu-8-async.yaml), with a reward pool.
ONE_STEP_OFF = {"mesh": "cpu-8-async", "actor_rollout_ref.hybrid_engine": "false",
                "reward.num_workers": 2, "trainer.test_freq": -1}


@pytest.mark.slow
def test_two_hosts_one_step_off_match_one_host(tmp_path):
    """The one-step-off mode on 2 Ray processes x 4 CPU devices: each host gives 2 devices
    to the one (2,2,1) train mesh and generates its half of each batch's prompts on its
    other 2, a (1,1,2) rollout mesh of its own. Its steps log the metrics of the one
    8-device process (4 train + 4 rollout devices) within 1e-5, and so does a third step
    after both resume from step 2, whose batch is generated again from the checkpoint's
    older weights (kept in the train layout, across the hosts)."""
    from rlhf_jax.trainer import train

    split = [f"{k}={v}" for k, v in ONE_STEP_OFF.items()]
    code, out, err, _ = _launch(_hosts(tmp_path / "hosts", *split), tmp_path, timeout=900)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "launch_ray: host 1 finished (2 steps)" in out
    train(tiny(tmp_path / "one", **ONE_STEP_OFF))
    hosts, _ = _same_steps(tmp_path, [1, 2], skip=("async/idle_fraction/",))
    assert [hosts[s]["async/staleness"] for s in (1, 2)] == [0.0, 1.0]

    more = {"trainer.total_training_steps": 3}
    code, out, err, _ = _launch(_hosts(tmp_path / "hosts", *split, *(
        f"{k}={v}" for k, v in more.items())), tmp_path, 900)
    assert code == 0, (out[-3000:], err[-3000:])
    assert "launch_ray: host 1 finished (3 steps)" in out
    train(tiny(tmp_path / "one", **ONE_STEP_OFF, **more))
    hosts, _ = _same_steps(tmp_path, [1, 2, 3], skip=("async/idle_fraction/",))
    assert hosts[3]["async/staleness"] == 1.0


def _same_steps(tmp: Path, steps: list[int], skip: tuple[str, ...] = ()):
    """The metrics of `hosts/run` and `one/run`, equal but for the machine's (1e-5)."""
    hosts, one = steps_logged(tmp / "hosts/run"), steps_logged(tmp / "one/run")
    assert list(hosts) == list(one) == steps
    for step in steps:
        a = {k: v for k, v in hosts[step].items() if not k.startswith((*MACHINE, *skip))}
        b = {k: v for k, v in one[step].items() if not k.startswith((*MACHINE, *skip))}
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-5, rel=1e-6), (step, k)
    return hosts, one
