"""Multi-process runs through jax's own multi-controller runtime (`jax.distributed`).

How a process learns that it is one of several (`resolve_launch`, jax-free, so a mistake is
reported before jax starts), from three sources:
  flags        --coordinator HOST:PORT --num-processes N --process-id I
  environment  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
  cluster      jax's own detection: SLURM (srun: SLURM_NTASKS, SLURM_PROCID), Open MPI (mpirun:
               OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK), a Kubernetes Indexed Job
               (JOB_COMPLETION_INDEX; jax reads the process count from the Job)
Every source that gives a value must give the same one, or the launch is refused in one line. A
cluster's coordinator is jax's to derive (the first host of the job). With none of them, or one
process in all, the run is a single process exactly as without this module: `start` returns
None and never calls `jax.distributed.initialize`.

Failure. `start` runs a watchdog thread in every process: each beats a counter in the
coordination service's key-value store every second; a process that has not beaten for
`failure_timeout` seconds (killed, crashed, hung) or that reported a failure (`Runtime.fail`)
ends every other process with one line on stderr and exit status 1, within that timeout and
`GRACE_S`. jax's own heartbeat (`heartbeat_timeout`, twice that plus 10 s) is the backstop: it
ends a process the watchdog could not (with jax's message, by SIGABRT).
A process that loses process 0, which hosts the coordination service, is ended by jax's runtime
at once (SIGABRT, "Terminating process because the JAX distributed service detected fatal
errors", then a stack trace), or by its collective library (gloo's std::terminate on a CPU). So
that it too ends with one line, every process but 0 writes its stderr through a pipe to a small
forked reader (`_forward_stderr`) that passes everything on until such an end begins, then
writes our line instead and drops the rest. A collective's end names process 0 when the
coordinator's port closes within `COORDINATOR_GONE_S` (a killed process's sockets close only after
its memory is freed), and otherwise blames another process.
`jax.distributed.initialize` waits `INITIALIZATION_TIMEOUT_S` for every process to start.

Agreement. `agree` refuses processes started with different payloads (the resolved config and
the run's options), naming the fields; `share_from_primary` hands process 0's answer (the
checkpoint to resume, after verifying its checksums) to the others; `barrier` waits for all.
They use the coordination service's key-value store, not the devices.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_FAILURE_TIMEOUT_S = 60
MIN_FAILURE_TIMEOUT_S = 5
INITIALIZATION_TIMEOUT_S = 300
# How long `agree`, `share_from_primary` and `barrier` wait for the slowest process (the watchdog
# ends a wait on a process that is gone well before).
SYNC_TIMEOUT_S = 300
# Beats and checks of the watchdog; process 0 outlives a failure by GRACE_S so that every other
# process reads the failure from its key-value store before the store goes away with it.
BEAT_INTERVAL_S = 1.0
GRACE_S = 2.5 * BEAT_INTERVAL_S
_PREFIX = "pisa-jax"
_WATCH = f"{_PREFIX}/watch"


class LaunchError(ValueError):
  """The flags and the environment do not describe one launch; the message names them."""


class MismatchError(ValueError):
  """The processes were started with different configs or options."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """Where this process stands in its launch.

  num_processes: None when only jax's cluster detection can tell (a Kubernetes Job's
  parallelism). coordinator: None when jax's cluster detection derives it. cluster: "SLURM",
  "Open MPI" or "Kubernetes" when jax's detection takes part, else None.
  """

  num_processes: int | None = 1
  process_id: int = 0
  coordinator: str | None = None
  cluster: str | None = None
  failure_timeout: int = DEFAULT_FAILURE_TIMEOUT_S

  @property
  def multi_process(self) -> bool:
    return self.num_processes != 1

  @property
  def primary(self) -> bool:
    return self.process_id == 0

  def describe(self) -> str:
    of = "?" if self.num_processes is None else self.num_processes
    via = f" ({self.cluster})" if self.cluster else ""
    return f"process {self.process_id} of {of}{via}"


def _cluster(environ: Mapping[str, str]) -> tuple[str, dict[str, tuple[str, str]]] | None:
  """The cluster jax's detection would find, as (name, {field: (variable, text)}), in jax's
  order of detection (`jax._src.clusters`): Open MPI, SLURM, Kubernetes."""
  ompi = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
  if "OMPI_MCA_orte_hnp_uri" in environ or all(v in environ for v in ompi):
    return "Open MPI", {"num_processes": (ompi[0], environ.get(ompi[0])),
                        "process_id": (ompi[1], environ.get(ompi[1]))}
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
  if all(v in environ for v in slurm):
    return "SLURM", {"num_processes": ("SLURM_NTASKS", environ["SLURM_NTASKS"]),
                     "process_id": ("SLURM_PROCID", environ["SLURM_PROCID"])}
  if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ:
    return "Kubernetes", {"process_id": ("JOB_COMPLETION_INDEX", environ["JOB_COMPLETION_INDEX"])}
  return None


def _int(name: str, text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise LaunchError(f"{name}={text!r} is not an int") from None


def _check_coordinator(name: str, address: str) -> str:
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise LaunchError(f"{name}={address!r} must be HOST:PORT (a port in 1..65535), the address "
                      f"process 0 listens on")
  return address


def resolve_launch(coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, *, failure_timeout: int | None = None,
                   environ: Mapping[str, str] = os.environ) -> Launch:
  """The launch the flags (None: not given), the JAX_* variables and the cluster describe (the
  module docstring gives the rules). Raises LaunchError in one line naming what disagrees or is
  missing. Imports nothing of jax."""
  timeout = DEFAULT_FAILURE_TIMEOUT_S if failure_timeout is None else failure_timeout
  if timeout < MIN_FAILURE_TIMEOUT_S:
    raise LaunchError(f"--failure-timeout={timeout} must be >= {MIN_FAILURE_TIMEOUT_S} seconds")
  given: dict[str, list[tuple[str, Any]]] = {"coordinator": [], "num_processes": [],
                                             "process_id": []}
  for field, flag, value in (("coordinator", "--coordinator", coordinator),
                             ("num_processes", "--num-processes", num_processes),
                             ("process_id", "--process-id", process_id)):
    if value is not None:
      given[field].append((flag, value))
  for field, variable in (("coordinator", ENV_COORDINATOR), ("num_processes", ENV_NUM_PROCESSES),
                          ("process_id", ENV_PROCESS_ID)):
    if environ.get(variable, "").strip():
      text = environ[variable].strip()
      given[field].append((variable, text if field == "coordinator" else _int(variable, text)))
  cluster = _cluster(environ)
  if cluster is not None:
    for field, (variable, text) in cluster[1].items():
      given[field].append((f"{variable} ({cluster[0]})", _int(variable, text or "")))
  for field, values in given.items():
    if len({v for _, v in values}) > 1:
      raise LaunchError(" disagrees with ".join(f"{name}={v!r}" for name, v in values)
                        + ": give the launch once, or the same values everywhere")

  def value(field):
    return given[field][0][1] if given[field] else None

  def name(field):
    return given[field][0][0]

  n, i, address = value("num_processes"), value("process_id"), value("coordinator")
  cluster_name = cluster[0] if cluster else None
  if n is None and i is None and address is None:
    return Launch(failure_timeout=timeout)
  if n is None and cluster_name != "Kubernetes":
    raise LaunchError(f"{name('coordinator' if address else 'process_id')} is given but not the "
                      f"number of processes: add --num-processes N (or {ENV_NUM_PROCESSES})")
  if n is not None and n < 1:
    raise LaunchError(f"{name('num_processes')}={n} must be >= 1")
  if i is None:
    raise LaunchError(f"{name('num_processes')}={n} needs this process's index: add "
                      f"--process-id I (or {ENV_PROCESS_ID}), 0 on the coordinator's host")
  if i < 0 or (n is not None and i >= n):
    raise LaunchError(f"{name('process_id')}={i} must be in 0..{(n or 1) - 1}"
                      + (f" ({name('num_processes')}={n})" if n is not None else ""))
  if address is not None:
    _check_coordinator(name("coordinator"), address)
  if n == 1:
    return Launch(failure_timeout=timeout)
  if address is None and cluster_name is None:
    raise LaunchError(f"{name('num_processes')}={n} needs the coordinator: add --coordinator "
                      f"HOST:PORT (or {ENV_COORDINATOR}), an address of process 0's host")
  if cluster_name == "Kubernetes" and importlib.util.find_spec("kubernetes") is None:
    raise LaunchError(
        "JOB_COMPLETION_INDEX (Kubernetes) starts a multi-process run, whose process count jax "
        "reads through the kubernetes package, which is not installed: pip install 'jax[k8s]', "
        "or give --coordinator, --num-processes and --process-id")
  return Launch(num_processes=n, process_id=i, coordinator=address, cluster=cluster_name,
                failure_timeout=timeout)


def launch_from_environment(environ: Mapping[str, str] = os.environ) -> Launch:
  """The launch the environment alone describes (for tools without the flags)."""
  return resolve_launch(environ=environ)


# ----------------------------------------------------------------------------------------------
# The runtime (imports jax).


def _client():
  """The coordination service client of `jax.distributed` (its key-value store and barriers)."""
  from jax._src import distributed

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized: start the runtime first")
  return client


def _stderr_line(text: str) -> None:
  """Flushes what Python buffered, then writes one line to stderr unbuffered."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os.write(2, (text.rstrip("\n") + "\n").encode())


class _Watchdog(threading.Thread):
  """Beats this process's counter and ends the process when another one stops (module docstring)."""

  def __init__(self, client, process_id: int, num_processes: int, timeout: float, prog: str):
    super().__init__(name="pisa-jax-watchdog", daemon=True)
    self.client, self.process_id, self.num = client, process_id, num_processes
    self.timeout, self.prog = timeout, prog
    self.halt = threading.Event()

  def run(self):
    beats = 0
    now = time.monotonic()
    seen = {p: (None, now) for p in range(self.num) if p != self.process_id}
    while not self.halt.wait(BEAT_INTERVAL_S):
      beats += 1
      try:
        self.client.key_value_set(f"{_WATCH}/beat/{self.process_id}", str(beats),
                                  allow_overwrite=True)
        entries = dict(self.client.key_value_dir_get(f"{_WATCH}/"))
      except Exception as e:  # the store went away with process 0
        if self.halt.is_set():
          return
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        self.end(f"lost process 0, which hosts the coordination service ({first})", True)
        return
      if self.halt.is_set():
        return
      now = time.monotonic()
      for p in seen:
        failure = entries.get(f"{_WATCH}/failed/{p}")
        if failure is not None:
          self.end(f"process {p} of {self.num} failed: {failure}", False)
          return
      for p, (last, since) in seen.items():
        if f"{_WATCH}/done/{p}" in entries:
          continue
        beat = entries.get(f"{_WATCH}/beat/{p}")
        if beat != last:
          seen[p] = (beat, now)
        elif now - since > self.timeout:
          self.end(f"process {p} of {self.num} has not answered for {self.timeout:g} s "
                   f"(killed, crashed or hung)", True)
          return

  def end(self, reason: str, resume: bool) -> None:
    """Ends this process with one line: `reason`, and with `resume` how to go on."""
    advice = (": run the same command on every process again to resume from the last complete "
              "checkpoint" if resume else "")
    _stderr_line(f"{self.prog}: error: {reason}; stopped process {self.process_id} too{advice}")
    if self.process_id == 0:
      time.sleep(GRACE_S)
    os._exit(1)


@dataclasses.dataclass
class Runtime:
  """The started runtime of this process: its launch and its watchdog."""

  launch: Launch
  watchdog: _Watchdog

  def done(self) -> None:
    """This process ends normally: the others stop watching it, and it stops watching them."""
    self.watchdog.halt.set()
    try:
      _client().key_value_set(f"{_WATCH}/done/{self.launch.process_id}", "1")
    except Exception:  # process 0 has gone already: nobody is left to watch this one
      pass

  def fail_unforeseen(self, error: BaseException):
    """Ends this process on an error it did not foresee, often the effect of another process's
    end (a collective cut short): the watchdog gets its timeout to find that out and say so in
    its line; otherwise the traceback, then `fail`. Never returns."""
    if self.watchdog.is_alive():
      # The silence it measures began up to a beat before this error; it checks once a beat.
      self.watchdog.join(self.launch.failure_timeout + 4 * BEAT_INTERVAL_S)
    traceback.print_exception(error)
    first = str(error).splitlines()[0] if str(error) else ""
    self.fail(f"{self.watchdog.prog}: error: {type(error).__name__}: {first}")

  def fail(self, line: str, status: int = 1):
    """Ends this process after printing `line`: the others read it and end too (process 0 waits
    until they have). Never returns."""
    self.watchdog.halt.set()
    _stderr_line(line)
    try:
      _client().key_value_set(f"{_WATCH}/failed/{self.launch.process_id}",
                              line.split(": error: ", 1)[-1], allow_overwrite=True)
    except Exception:  # the store is gone: the others learn it from jax's runtime
      pass
    if self.launch.primary:
      time.sleep(GRACE_S)
    os._exit(status)


# The first line jax's runtime writes when the coordination service is gone (absl log lines: the
# agent's error, then the fatal message it ends the process with).
_JAX_END = (b"Polled an error from coordination service",
            b"Terminating process because the JAX distributed service detected fatal errors")
# A collective library's end of the process when a peer vanished mid-collective (gloo on CPUs
# can notice before the coordination service does).
_TERMINATE = b"terminate called after throwing an instance of"
# How long a collective's end waits to see the coordinator's port close before it blames another
# process (one that is not process 0 leaves the port open for `failure_timeout` and more).
COORDINATOR_GONE_S = 3.0


def _unreachable(address: str | None, within_s: float = COORDINATOR_GONE_S) -> bool:
  """Whether the coordinator's HOST:PORT stops accepting connections within `within_s` seconds
  (None: unknown). A killed process 0 closes its sockets only after the kernel has freed its
  memory, so a peer's collective can fail a moment before the port does."""
  if not address:
    return False
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + within_s
  while True:
    try:
      socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
    except OSError:
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.1)


def _lost_coordinator_line(prog: str, process_id: int, text: bytes) -> str:
  """Our line for jax's end of this process, quoting its status's first sentence."""
  status = text.split(b"absl::Status: ", 1)[1] if b"absl::Status: " in text else b""
  cause = status.decode(errors="replace").split(". ", 1)[0].strip()
  cause = f" ({cause})" if cause else ""
  return (f"{prog}: error: lost process 0, which hosts the coordination service{cause}; stopped "
          f"process {process_id} too: run the same command on every process again to resume "
          f"from the last complete checkpoint")


def _ending_line(prog: str, process_id: int, coordinator: str | None, text: bytes) -> str:
  """Our line for a fatal ending that starts at `text`: jax's for a lost coordinator, or a
  collective's, which is the coordinator's loss too when its address no longer answers."""
  if any(marker in text for marker in _JAX_END) or _unreachable(coordinator):
    return _lost_coordinator_line(prog, process_id, text)
  what = text.split(b"what():", 1)[1] if b"what():" in text else text
  first = what.decode(errors="replace").strip().splitlines()[0][:160] if what.strip() else ""
  return (f"{prog}: error: process {process_id} was ended inside a collective ({first}), most "
          f"likely because another process ended (its output says why): run the same command "
          f"on every process again to resume from the last complete checkpoint")


def _forward_stderr(prog: str, process_id: int, coordinator: str | None) -> None:
  """Routes this process's stderr (fd 2) through a forked reader that copies it to the real
  stderr until jax's runtime starts ending the process for a lost coordinator (`_JAX_END`), or
  a collective library ends it (`_TERMINATE`), then writes one line of ours in place of theirs
  and drops what follows (tracebacks of threads cut short, the abort's stack trace). The reader ignores Ctrl-C and SIGTERM (the process
  itself stops on them) and exits once every writer has closed the pipe."""
  read_end, write_end = os.pipe()
  pid = os.fork()
  if pid == 0:  # the reader: only os-level calls, safe in a child forked from threads
    try:
      signal.signal(signal.SIGINT, signal.SIG_IGN)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      os.close(write_end)
      pending, ended = b"", False
      while chunk := os.read(read_end, 1 << 16):
        if ended:
          continue
        pending += chunk
        lines = pending.split(b"\n")
        pending = lines.pop()
        for i, line in enumerate(lines):
          if any(marker in line for marker in (*_JAX_END, _TERMINATE)):
            if _TERMINATE in line and b"what():" not in b"".join(lines[i:] + [pending]):
              # std::terminate's reason follows on the next line: wait for it.
              time.sleep(0.05)
              more = os.read(read_end, 1 << 16)
              pending += more
            rest = b"\n".join(lines[i:] + [pending])
            # What a progress bar left before the ending on this line (after its last \r) stays.
            marker = min(line.find(m) for m in (*_JAX_END, _TERMINATE) if m in line)
            start = line.rfind(b"\r", 0, marker) + 1
            os.write(2, line[:start] + (b"\n" if start else b"") +
                     (_ending_line(prog, process_id, coordinator, rest) + "\n").encode())
            ended = True
            break
          os.write(2, line + b"\n")
        if not ended and pending and not pending.startswith((b"E", b"F")):
          # A partial line (a progress bar's carriage returns) goes on at once; a possible log
          # line waits for its end to be recognised.
          os.write(2, pending)
          pending = b""
      if pending and not ended:
        os.write(2, pending)
    finally:
      os._exit(0)
  os.close(read_end)
  sys.stderr.flush()
  os.dup2(write_end, 2)
  os.close(write_end)


def heartbeat_timeout(failure_timeout: int) -> int:
  """jax's heartbeat timeout for a watchdog of `failure_timeout` seconds: late enough that the
  watchdog, with its grace, speaks first."""
  return 2 * failure_timeout + 10


def start(launch: Launch, *, prog: str = "pisa-jax") -> Runtime | None:
  """Starts jax's runtime for a multi-process `launch` (None for one process: nothing is done).

  Before any jax computation: CPU collectives through gloo (a CPU run across processes needs
  them), jax's preemption service off (SIGTERM stays the tool's: a checkpoint and exit 143),
  `jax.distributed.initialize`, then the watchdog. Raises RuntimeError in one line when the
  runtime cannot start.
  """
  if not launch.multi_process:
    return None
  if not launch.primary:
    _forward_stderr(prog, launch.process_id, launch.coordinator)
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_preemption_service", False)
  try:
    jax.distributed.initialize(
        coordinator_address=launch.coordinator, num_processes=launch.num_processes,
        process_id=launch.process_id,
        cluster_detection_method=None if launch.cluster else "deactivate",
        initialization_timeout=INITIALIZATION_TIMEOUT_S,
        heartbeat_timeout_seconds=heartbeat_timeout(launch.failure_timeout),
        shutdown_timeout_seconds=launch.failure_timeout)
  except Exception as e:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise RuntimeError(
        f"cannot start jax's distributed runtime as {launch.describe()} with coordinator "
        f"{launch.coordinator or '(from the cluster)'}: {first}") from None
  watchdog = _Watchdog(_client(), jax.process_index(), jax.process_count(),
                       launch.failure_timeout, prog)
  watchdog.start()
  return Runtime(launch=dataclasses.replace(launch, num_processes=jax.process_count(),
                                            process_id=jax.process_index()),
                 watchdog=watchdog)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def differences(mine: dict, reference: dict, *, here: str = "here") -> list[str]:
  """`field: X on <here>, Y on process 0` for every leaf of two JSON-like trees that differs."""
  a, b = _flat(json.loads(json.dumps(mine))), _flat(json.loads(json.dumps(reference)))
  return [f"{k}: {a.get(k)!r} on {here}, {b.get(k)!r} on process 0"
          for k in list(b) + [k for k in a if k not in b] if a.get(k) != b.get(k)]


_uses: dict[str, int] = {}


def _key(kind: str, name: str) -> str:
  """A fresh key for the n-th `kind/name` of this process: every process calls the same ones
  in the same order, and the store refuses a key written twice."""
  n = _uses[f"{kind}/{name}"] = _uses.get(f"{kind}/{name}", -1) + 1
  return f"{_PREFIX}/{kind}/{name}/{n}"


def _get(client, key: str) -> str:
  return client.blocking_key_value_get(key, SYNC_TIMEOUT_S * 1000)


def agree(name: str, payload: dict) -> None:
  """Raises MismatchError on every process when any process's `payload` (JSON-able) differs
  from process 0's, naming the first such process and its fields. One process: nothing to do."""
  import jax

  if jax.process_count() == 1:
    return
  client, me, key = _client(), jax.process_index(), _key("agree", name)
  text = json.dumps(payload, sort_keys=True)
  if me == 0:
    client.key_value_set(f"{key}/payload", text)
  reference = text if me == 0 else _get(client, f"{key}/payload")
  diff = differences(payload, json.loads(reference), here=f"process {me}")
  client.key_value_set(f"{key}/verdict/{me}", "; ".join(diff))
  client.wait_at_barrier(f"{key}/barrier", SYNC_TIMEOUT_S * 1000)
  verdicts = sorted((int(k.rsplit("/", 1)[1]), v)
                    for k, v in client.key_value_dir_get(f"{key}/verdict/") if v)
  if verdicts:
    p, first = verdicts[0]
    more = f" (and {len(verdicts) - 1} more)" if len(verdicts) > 1 else ""
    raise MismatchError(f"process {p}{more} was started differently from process 0 ({first}): "
                        f"give every process the same command and config")


def share_from_primary(name: str, compute: Callable[[], Any]) -> Any:
  """Process 0's `compute()` (a JSON-able value), returned on every process; the others never
  call it. One process: `compute()`."""
  import jax

  if jax.process_count() == 1:
    return compute()
  client, key = _client(), _key("shared", name)
  if jax.process_index() == 0:
    value = compute()
    client.key_value_set(key, json.dumps(value))
    return value
  return json.loads(_get(client, key))


def barrier(name: str, timeout_s: float = SYNC_TIMEOUT_S) -> None:
  """Waits until every process has reached `name`, at most `timeout_s`."""
  import jax

  if jax.process_count() > 1:
    _client().wait_at_barrier(_key("barrier", name), int(timeout_s * 1000))
