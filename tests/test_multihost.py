"""Multi-process training through jax.distributed, on CPU: local processes, gloo collectives, fake
devices in each.

How a launch is read (flags, JAX_* variables, SLURM / Open MPI / Kubernetes), the mesh layout,
the refusal of processes started differently and the watchdog are checked in-process, and
pisa-eval refuses a multi-process launch (it runs on one device). One run of 2 processes x 2
devices (in CI) resumes a one-process checkpoint, trains the losses one process trains over the
same global batch, writes checkpoints one process restores to the same state, and loses a
process to kill -9: the other ends with one line within the failure timeout, and a rerun
resumes from the last complete checkpoint. Slow: 4 processes resume the 2-process
checkpoint (environment launch), and processes given different configs are refused.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.models.sharding import mesh_devices
from pisa_jax.train import checkpoint as ckpt_lib
from pisa_jax.train import distributed
from pisa_jax.train.distributed import Launch, LaunchError, resolve_launch
from pisa_jax.train.trainer import build_trainer, train

# A model that compiles in seconds (as tests/test_train.py's MICRO): global batch 8, a checkpoint
# and an evaluation every 2 steps, a loss row every step; 1000 steps so a run outlives the kill.
MICRO = [
    "model.vocab_size=64", "model.vocab_pad_multiple=64", "model.num_layers=1",
    "model.d_model=32", "model.mlp_dim=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=16", "model.block_size=16", "model.top_k=3", "data.mqar_num_pairs=4",
    "train.seq_len=64", "train.grad_accum=2", "train.steps=1000", "train.warmup_steps=2",
    "train.decay_steps=2", "train.checkpoint_every=2", "train.keep_checkpoints=1000",
    "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.peak_lr=3e-3",
]
GLOBAL_BATCH = 8
FAILURE_TIMEOUT = 5
# The bound on a survivor's end after a kill: the watchdog's timeout, a beat, process 0's grace,
# and slack for a loaded machine.
END_BOUND_S = FAILURE_TIMEOUT + 2 * distributed.BEAT_INTERVAL_S + distributed.GRACE_S + 15


def micro_config(per_device_batch: int):
  return validate(apply_overrides(get_config("tiny"), MICRO + [
      f"train.per_device_batch={per_device_batch}"]))


# ---------------------------------------------------------------------------------------------
# The launch, read before jax.

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "4",
         "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("flags,environ,expected", [
    ({}, {}, Launch()),
    ({}, SLURM | {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, Launch()),
    (dict(coordinator="h:1", num_processes=2, process_id=1), {},
     Launch(num_processes=2, process_id=1, coordinator="h:1")),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     Launch(num_processes=2, process_id=0, coordinator="h:1")),
    (dict(process_id=1), {"JAX_COORDINATOR_ADDRESS": "[::1]:9", "JAX_NUM_PROCESSES": "3"},
     Launch(num_processes=3, process_id=1, coordinator="[::1]:9")),
    ({}, SLURM, Launch(num_processes=4, process_id=2, cluster="SLURM")),
    (dict(num_processes=4), SLURM, Launch(num_processes=4, process_id=2, cluster="SLURM")),
    ({}, {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, Launch(num_processes=2, process_id=1,
                                                     cluster="Open MPI")),
], ids=["alone", "slurm-one-task", "flags", "environment", "flags-and-environment", "slurm",
        "slurm-and-flag", "open-mpi"])
def test_a_launch_is_read_from_flags_environment_and_cluster(flags, environ, expected):
  assert resolve_launch(**flags, environ=environ) == expected
  assert expected.multi_process == (expected.num_processes != 1)
  if not expected.multi_process:  # one process never starts jax's runtime
    assert distributed.start(expected) is None


@pytest.mark.parametrize("flags,environ,message", [
    (dict(num_processes=2, process_id=0), {},
     "--num-processes=2 needs the coordinator: add --coordinator HOST:PORT"),
    (dict(coordinator="h:1", num_processes=2), {},
     "--num-processes=2 needs this process's index: add --process-id I"),
    (dict(coordinator="h:1", process_id=0), {},
     "--coordinator is given but not the number of processes"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), {},
     "--process-id=2 must be in 0..1 (--num-processes=2)"),
    (dict(coordinator="h", num_processes=2, process_id=0), {},
     "--coordinator='h' must be HOST:PORT"),
    (dict(coordinator="h:1", num_processes=2, process_id=0), {"JAX_NUM_PROCESSES": "4"},
     "--num-processes=2 disagrees with JAX_NUM_PROCESSES=4"),
    ({}, SLURM | {"JAX_PROCESS_ID": "1"},
     "JAX_PROCESS_ID=1 disagrees with SLURM_PROCID (SLURM)=2"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not an int"),
    ({}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"},
     "JOB_COMPLETION_INDEX (Kubernetes) starts a multi-process run"),
], ids=["no-coordinator", "no-index", "no-count", "index-too-big", "no-port", "disagree",
        "disagree-cluster", "not-an-int", "kubernetes-package"])
def test_a_launch_that_does_not_add_up_is_refused_in_one_line(flags, environ, message):
  with pytest.raises(LaunchError) as e:
    resolve_launch(**flags, environ=environ)
  assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


NO_JAX = textwrap.dedent("""
    import json, os, sys
    from pisa_jax.train import cli

    def status(argv):
      try:
        cli.main(argv)
      except SystemExit as e:
        return [e.code, "jax" in sys.modules]

    out = {"no_index": status(["--num-processes", "2", "--coordinator", "h:1"]),
           "negative": status(["--process-id", "-1"]),
           "timeout": status(["--failure-timeout", "2", "--num-processes", "2",
                              "--process-id", "0", "--coordinator", "h:1"])}
    os.environ["JAX_NUM_PROCESSES"] = "4"
    out["disagree"] = status(["--num-processes", "2", "--process-id", "0", "--coordinator", "h:1"])
    # pisa-eval runs in one process: launched as several, it refuses.
    from pisa_jax.train.evaluation import cli as eval_cli
    del os.environ["JAX_NUM_PROCESSES"]
    os.environ.update(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n1", SLURM_NTASKS="2",
                      SLURM_PROCID="1", SLURM_LOCALID="1")
    try:
      eval_cli.main(["--workdir", ".", "--suite", "ppl"])
    except SystemExit as e:
      out["eval"] = [e.code, "jax" in sys.modules]
    print(json.dumps(out))
""")


def test_launch_mistakes_are_reported_before_jax_is_imported():
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_"))}
  proc = subprocess.run([sys.executable, "-c", NO_JAX], capture_output=True, text=True,
                        timeout=120, env=env | {"JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert all(v == [2, False] for v in out.values()), out
  assert [line for line in proc.stderr.splitlines() if "error:" in line] == [
      "pisa-train: error: --num-processes=2 needs this process's index: add --process-id I (or "
      "JAX_PROCESS_ID), 0 on the coordinator's host",
      "pisa-train: error: argument --process-id: -1 must be >= 0",
      "pisa-train: error: --failure-timeout=2 must be >= 5 seconds",
      "pisa-train: error: --num-processes=2 disagrees with JAX_NUM_PROCESSES=4: give the launch "
      "once, or the same values everywhere",
      "pisa-eval: error: launched as process 1 of 2 (SLURM): pisa-eval evaluates in one process "
      "on one device; run it once (srun --ntasks=1, or without the JAX_* variables)"], proc.stderr


# ---------------------------------------------------------------------------------------------
# The mesh and the agreement, in-process.


def _devices(processes: int, per_process: int):
  # Ids as jax numbers CPU devices of several processes, listed out of order.
  return [SimpleNamespace(process_index=p, id=p * 2048 + i)
          for i in reversed(range(per_process)) for p in reversed(range(processes))]


def test_the_mesh_keeps_seq_and_fsdp_inside_a_process():
  def processes(layout):
    return np.vectorize(lambda d: d.process_index)(layout)

  # 2 processes x 4 devices, fsdp = a process's devices: data spans the processes.
  layout = mesh_devices(_devices(2, 4))
  assert layout.shape == (2, 4)
  np.testing.assert_array_equal(processes(layout), [[0] * 4, [1] * 4])
  # Context parallelism 2 and fsdp 2 inside each process, ids in order within it.
  layout = mesh_devices(_devices(2, 4), fsdp=-1, context_parallel=2)
  assert layout.shape == (2, 2, 2)
  np.testing.assert_array_equal(processes(layout)[:, :, 0], [[0, 0], [1, 1]])
  assert [d.id for d in layout[1].ravel()] == [2048, 2049, 2050, 2051]
  # One device per process (one process per GPU): fsdp 4 spans 4 consecutive processes.
  layout = mesh_devices(_devices(8, 1), fsdp=4)
  np.testing.assert_array_equal(processes(layout), [[0, 1, 2, 3], [4, 5, 6, 7]])
  # Each process holds a contiguous block of the batch rows, in process order.
  for layout in (mesh_devices(_devices(4, 2)), mesh_devices(_devices(8, 1), fsdp=4)):
    rows = processes(layout.reshape(-1))
    assert list(rows) == sorted(rows)
  with pytest.raises(ValueError, match=r"train.context_parallel=4 must be >= 1 and divide the 2 "
                                       r"local devices \(a sequence's shards stay in one process"):
    mesh_devices(_devices(2, 2), context_parallel=4)
  with pytest.raises(ValueError, match=r"train.fsdp=3 must divide the 2 local devices, or span "
                                       r"whole processes \(2 devices each, 8 in all\)"):
    mesh_devices(_devices(4, 2), fsdp=3)


class _Store:
  """An in-memory stand-in for the coordination service's key-value store."""

  def __init__(self, entries=()):
    self.entries = dict(entries)

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.entries, key
    self.entries[key] = value

  def blocking_key_value_get(self, key, timeout_in_ms):
    return self.entries[key]

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.entries.items() if k.startswith(prefix)]

  def wait_at_barrier(self, name, timeout_in_ms):
    pass


def test_processes_started_differently_are_refused_naming_the_field(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  mine = {"config": {"train": {"peak_lr": 1e-3, "steps": 8}}, "run_steps": None}
  theirs = {"config": {"train": {"peak_lr": 3e-3, "steps": 8}}, "run_steps": None}
  # Process 0 has written its payload and found itself equal to itself.
  store = _Store({"pisa-jax/agree/x/0/payload": json.dumps(theirs),
                  "pisa-jax/agree/x/0/verdict/0": ""})
  monkeypatch.setattr(distributed, "_client", lambda: store)
  monkeypatch.setattr(distributed, "_uses", {})
  with pytest.raises(distributed.MismatchError) as e:
    distributed.agree("x", mine)
  assert str(e.value) == ("process 1 was started differently from process 0 (config.train.peak_lr:"
                          " 0.001 on process 1, 0.003 on process 0): give every process the same "
                          "command and config")
  store.entries["pisa-jax/agree/x/1/payload"] = json.dumps(theirs)
  store.entries["pisa-jax/agree/x/1/verdict/0"] = ""
  distributed.agree("x", theirs)


@pytest.mark.parametrize("entries,reason", [
    ({"pisa-jax/watch/failed/1": "loss is nan at step 3"},
     ("process 1 of 3 failed: loss is nan at step 3", False)),
    ({"pisa-jax/watch/done/1": "1"},
     ("process 2 of 3 has not answered for 0.5 s (killed, crashed or hung)", True)),
])
def test_the_watchdog_ends_the_process_when_another_fails_or_goes_silent(entries, reason,
                                                                         monkeypatch):
  monkeypatch.setattr(distributed, "BEAT_INTERVAL_S", 0.05)
  store = _Store(entries)
  # Process 2 beats; process 1 is done (or failed), process 2 beats on; only process 0 is watched.
  store.key_value_set("pisa-jax/watch/beat/2", "1")
  ended = []
  watchdog = distributed._Watchdog(store, process_id=0, num_processes=3, timeout=0.5, prog="t")
  watchdog.end = lambda why, resume: (ended.append((why, resume)), watchdog.halt.set())
  watchdog.start()
  watchdog.join(10)
  assert ended == [reason]
  assert int(store.entries["pisa-jax/watch/beat/0"]) >= 1


# ---------------------------------------------------------------------------------------------
# Processes.


@pytest.mark.parametrize("ending, expected", [
    (b"E1205 00:31:36.317953 26755 coordination_service_agent.cc:288] Polled an error from "
     b"coordination service.\nF1205 client.h:86] Terminating process because the JAX distributed "
     b"service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC. More.\n",
     "x: error: lost process 0, which hosts the coordination service (UNAVAILABLE: Failed to "
     "send RPC); stopped process 1 too: run the same command on every process again to resume "
     "from the last complete checkpoint"),
    (b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce "
     b"fail at pair.cc:459] size mismatch\n",
     "x: error: lost process 0, which hosts the coordination service; stopped process 1 too: run "
     "the same command on every process again to resume from the last complete checkpoint"),
])
def test_a_fatal_ending_of_the_runtime_becomes_one_line(tmp_path, ending, expected):
  # A process with the reader in place writes, then ends as jax's runtime or gloo ends it; the
  # coordinator's address answers nothing (a closed port), as after process 0 was killed.
  script = textwrap.dedent(f"""
      import os, sys
      from pisa_jax.train import distributed
      distributed._forward_stderr("x", 1, "127.0.0.1:{_free_port()}")
      print("step 3 | loss 4.2", file=sys.stderr, flush=True)
      sys.stderr.write("partial progress\\r")
      sys.stderr.flush()
      os.write(2, {ending!r})
      os.write(2, b"Traceback of a thread cut short\\n*** Check failure stack trace: ***\\n")
      os.abort()
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
  assert proc.returncode == -signal.SIGABRT
  time.sleep(0.2)  # the reader writes its line as the process dies
  lines = [line for line in proc.stderr.decode().replace("\r", "\n").splitlines() if line]
  assert lines == ["step 3 | loss 4.2", "partial progress", expected], lines


def test_a_collective_end_blames_process_0_only_once_its_port_closes():
  # gloo can fail a collective a moment before a killed process 0's port closes (the kernel
  # frees its memory first): the port closing within the wait still names process 0; a port
  # that keeps answering means another process ended.
  gloo = (b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  "
          b"[enforce fail at pair.cc:459] size mismatch\n")
  closing = socket.create_server(("127.0.0.1", 0))
  timer = threading.Timer(0.5, closing.close)
  timer.start()
  try:
    line = distributed._ending_line("x", 1, f"127.0.0.1:{closing.getsockname()[1]}", gloo)
  finally:
    timer.cancel()
    closing.close()
  assert line.startswith("x: error: lost process 0, which hosts the coordination service;"), line
  with socket.create_server(("127.0.0.1", 0)) as open_port:
    started = time.monotonic()
    line = distributed._ending_line("x", 2, f"127.0.0.1:{open_port.getsockname()[1]}", gloo)
    waited = time.monotonic() - started
  assert line.startswith("x: error: process 2 was ended inside a collective ([enforce fail at "
                         "pair.cc:459] size mismatch), most likely because another process "
                         "ended"), line
  assert waited >= distributed.COORDINATOR_GONE_S, waited


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _processes():
  """A list to add Popen objects to; every one still running at the end is killed (its whole
  process group), however the test ends."""
  started = []
  try:
    yield started
  finally:
    for proc in started:
      if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _launch(started, tmp_path, n, devices, workdir, extra, *, name, per_process=None,
            environment=False):
  """Starts `n` pisa-train processes of `devices` fake CPU devices each, on one coordinator
  port; their output goes to tmp_path/<name>-<i>.log."""
  port = _free_port()
  base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_"))}
  base |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  logs = []
  for i in range(n):
    argv = [sys.executable, "-m", "pisa_jax.train.cli", "--config", "tiny", "--no-progress",
            "--workdir", str(workdir), "--failure-timeout", str(FAILURE_TIMEOUT)]
    argv += [a for s in MICRO for a in ("--set", s)] + list(extra)
    argv += list((per_process or {}).get(i, []))
    env = dict(base)
    launch = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n),
              "JAX_PROCESS_ID": str(i)}
    if environment:
      env |= launch
    else:
      argv += ["--coordinator", launch["JAX_COORDINATOR_ADDRESS"], "--num-processes", str(n),
               "--process-id", str(i)]
    log = tmp_path / f"{name}-{i}.log"
    with open(log, "w") as out:
      started.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    logs.append(log)
  return started[-n:], logs


def _wait(procs, logs, timeout: float) -> list[int]:
  deadline = time.monotonic() + timeout
  for proc, log in zip(procs, logs):
    try:
      proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pytest.fail(f"{log.name} still running after {timeout} s:\n{log.read_text()[-3000:]}")
  return [p.returncode for p in procs]


def _ended(log, timeout: float = 10.0) -> str:
  """`log`'s text once its last line is our error line: a process's stderr reader writes it and
  may outlive the process by the moments it takes to see the coordinator's port close."""
  deadline = time.monotonic() + timeout
  while True:
    output = log.read_text()
    lines = output.rstrip().splitlines()
    if (lines and lines[-1].startswith("pisa-train: error:")) or time.monotonic() > deadline:
      return output
    time.sleep(0.1)


def _rows(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in _rows(workdir) if "loss" in r}


def _eval_losses(workdir) -> dict[int, float]:
  return {r["step"]: r["eval_loss"] for r in _rows(workdir) if "eval_loss" in r}


def _sealed(workdir) -> list[int]:
  folder = workdir / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir()
                if p.name.isdigit() and (p / ckpt_lib.MANIFEST).is_file())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One process (this one) trains the global batch of 8: steps 1-2, then a copy of its folder
  at step 2 for the other runs to resume, then steps 3-6."""
  tmp = tmp_path_factory.mktemp("reference")
  cfg = micro_config(GLOBAL_BATCH // jax.device_count())
  trainer = build_trainer(cfg)
  train(cfg, tmp / "run", run_steps=2, trainer=trainer, quiet=True, progress=False)
  shutil.copytree(tmp / "run", tmp / "at-step-2")
  train(cfg, tmp / "run", run_steps=4, trainer=trainer, quiet=True, progress=False)
  return SimpleNamespace(cfg=cfg, trainer=trainer, workdir=tmp / "run", start=tmp / "at-step-2")


def _restore(trainer, cfg, workdir, step):
  reader = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
  try:
    return reader.restore(step, trainer.abstract_state, cfg)
  finally:
    reader.close()


@pytest.fixture(scope="module")
def two_processes(reference, tmp_path_factory):
  """2 processes x 2 devices resume the one-process checkpoint at step 2 and train until process
  1 is killed, once checkpoint 4 is sealed."""
  tmp = tmp_path_factory.mktemp("two")
  workdir = tmp / "run"
  shutil.copytree(reference.start, workdir)
  with _processes() as started:
    procs, logs = _launch(started, tmp, 2, 2, workdir, ["--set", "train.per_device_batch=2"],
                          name="killed")
    deadline = time.monotonic() + 300
    while not (workdir / "checkpoints" / "4" / ckpt_lib.MANIFEST).is_file():
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
          logs[0].read_text()[-3000:])
      time.sleep(0.1)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    status = _wait(procs, logs, END_BOUND_S + 30)
    ended_after = time.monotonic() - killed
  return SimpleNamespace(workdir=workdir, status=status, ended_after=ended_after,
                         output=[log.read_text() for log in logs], sealed=_sealed(workdir),
                         tmp=tmp)


def test_two_processes_train_as_one_and_a_killed_one_ends_the_run(reference, two_processes):
  run = two_processes
  # Killed by kill -9, process 1 ended process 0 with one line, within the failure timeout.
  assert run.status == [1, -signal.SIGKILL], run.output[0][-3000:]
  last = run.output[0].rstrip().splitlines()[-1]
  assert last == (f"pisa-train: error: process 1 of 2 has not answered for {FAILURE_TIMEOUT} s "
                  f"(killed, crashed or hung); stopped process 0 too: run the same command on "
                  f"every process again to resume from the last complete checkpoint"), last
  assert run.ended_after < END_BOUND_S, run.ended_after
  # Resumed from a one-process checkpoint (1 -> 2), the losses and the evaluation equal one
  # process's over the same global batch.
  assert "resumed from" in run.output[0] and "/checkpoints/2 (step 2 of 1000)" in run.output[0]
  ours, ref = _losses(run.workdir), _losses(reference.workdir)
  np.testing.assert_allclose([ours[3], ours[4]], [ref[3], ref[4]], rtol=2e-6)
  np.testing.assert_allclose(_eval_losses(run.workdir)[4], _eval_losses(reference.workdir)[4],
                             rtol=2e-6)
  # Process 0 alone wrote: one row per step, no status lines from process 1.
  steps = [r["step"] for r in _rows(run.workdir) if "loss" in r]
  assert steps == sorted(set(steps)), steps
  assert "| loss" in run.output[0] and "| loss" not in run.output[1]
  assert "mesh {'data': 2, 'fsdp': 2} on 4 x cpu" in run.output[0]
  # The 2-process checkpoint restores in one process (2 -> 1) to the one-process state.
  cfg, trainer = reference.cfg, reference.trainer
  ours = _restore(trainer, cfg, run.workdir, 4)
  theirs = _restore(trainer, cfg, reference.workdir, 4)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  # A rerun (here one process) resumes from the last checkpoint that was sealed.
  last_good = run.sealed[-1]
  assert last_good >= 4
  result = train(cfg, run.workdir, run_steps=1, trainer=trainer, quiet=True, progress=False)
  assert (result.start_step, result.end_step) == (last_good, last_good + 1)


def test_four_processes_resume_two_and_the_coordinators_end_ends_them(reference, two_processes):
  """2 -> 4: the 2-process run's checkpoint 4, resumed by 4 processes x 1 device launched
  through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, trains as one process;
  then process 0, which hosts jax's coordination service, is killed: the others end with our
  one line, not jax's abort message."""
  tmp = two_processes.tmp
  ref = _losses(reference.workdir)
  workdir = tmp / "four"
  shutil.copytree(two_processes.workdir, workdir)
  for step in _sealed(workdir):
    if step > 4:
      shutil.rmtree(workdir / "checkpoints" / str(step))
  with _processes() as started:
    procs, logs = _launch(started, tmp, 4, 1, workdir, ["--set", "train.per_device_batch=2"],
                          name="four", environment=True)
    deadline = time.monotonic() + 400
    while not (workdir / "checkpoints" / "6" / ckpt_lib.MANIFEST).is_file():
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
          logs[0].read_text()[-3000:])
      time.sleep(0.1)
    os.kill(procs[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    status = _wait(procs, logs, END_BOUND_S + 30)
    ended_after = time.monotonic() - killed
  assert "mesh {'data': 4, 'fsdp': 1} on 4 x cpu" in logs[0].read_text()
  ours = _losses(workdir)
  np.testing.assert_allclose([ours[5], ours[6]], [ref[5], ref[6]], rtol=2e-6)
  assert ended_after < END_BOUND_S, ended_after
  for i in (1, 2, 3):
    output = _ended(logs[i])
    assert status[i] != 0, output[-3000:]
    last = output.rstrip().splitlines()[-1]
    assert last.startswith("pisa-train: error: lost process 0, which hosts the coordination "
                           "service"), output[-3000:]
    assert last.endswith(f"; stopped process {i} too: run the same command on every process "
                         f"again to resume from the last complete checkpoint"), last
    # jax's own ending (its fatal log line, the abort's stack trace) is not passed on.
    assert "Terminating process" not in output and "Check failure stack trace" not in output


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_set_aside_by_all_and_mismatched_processes_are_refused(
    reference, two_processes):
  tmp = two_processes.tmp
  ref = _losses(reference.workdir)
  # A 4-process checkpoint 6 over the 2-process run's checkpoint 4.
  workdir = tmp / "fallback"
  shutil.copytree(two_processes.workdir, workdir)
  for step in _sealed(workdir):
    if step > 4:
      shutil.rmtree(workdir / "checkpoints" / str(step))
  with _processes() as started:
    procs, logs = _launch(started, tmp, 4, 1, workdir,
                          ["--set", "train.per_device_batch=2", "--run-steps", "2"],
                          name="four-steps", environment=True)
    assert _wait(procs, logs, 400) == [3, 3, 3, 3], logs[0].read_text()[-3000:]
  assert logs[0].read_text().rstrip().splitlines()[-1] == (
      "stopped at step 6 of 1000 (--run-steps); rerun to continue")

  # 4 -> 2 with every process taking part in the fallback: checkpoint 6 (of 4 processes) is
  # corrupt, process 0 finds it, sets it aside, and all resume from 4.
  (workdir / "checkpoints" / "6" / "meta" / "metadata").write_text("{}")
  with _processes() as started:
    procs, logs = _launch(started, tmp, 2, 2, workdir,
                          ["--set", "train.per_device_batch=2", "--run-steps", "1"],
                          name="fallback")
    assert _wait(procs, logs, 300) == [3, 3], logs[0].read_text()[-3000:]
  output = logs[0].read_text()
  assert f"skipped checkpoint {workdir / 'checkpoints'}/6 (meta/metadata " in output, output[-3000:]
  assert f"resumed from {workdir / 'checkpoints'}/4 (step 4 of 1000)" in output
  assert (workdir / "skipped_checkpoints" / "6").is_dir()
  np.testing.assert_allclose(_losses(workdir)[5], ref[5], rtol=2e-6)
  # Processes given different configs stop before anything is written.
  fresh = tmp / "mismatch"
  with _processes() as started:
    procs, logs = _launch(started, tmp, 2, 1, fresh, ["--set", "train.per_device_batch=2"],
                          name="mismatch", per_process={1: ["--set", "train.peak_lr=1e-3"]})
    assert _wait(procs, logs, 200) == [1, 1]
  line = ("pisa-train: error: process 1 was started differently from process 0 "
          "(config.train.peak_lr: 0.001 on process 1, 0.003 on process 0): give every process "
          "the same command and config")
  # Process 1 says the same, or, if its watchdog reads process 0's failure first, quotes it.
  assert logs[0].read_text().rstrip().splitlines()[-1] == line, logs[0].read_text()[-2000:]
  assert line.split(": error: ")[1] in logs[1].read_text(), logs[1].read_text()[-2000:]
  assert not fresh.exists()
