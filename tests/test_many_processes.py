"""Many processes on localhost (issue 49): launch/local.sh with 4 processes x 2 devices and
8 processes x 1 device, the CPU simulation of a pod slice.

They train like one process of 8 devices on the same mesh, in either layout; each process's
input pipeline reads only its block of every batch (counted through a wrapper around the
source, below); a checkpoint of 8 processes resumes exactly on 4; SIGTERM to each of 8
processes stops them all at one step, saved. test_multihost.py does the same for 2.

Every run is bounded: local.sh's --timeout per process, and test_multihost's _wait,
which SIGKILLs every process of a run at its deadline, failing the test.

The read-counting runs' processes run tests/many_processes_reads.py, which counts what
each reads (the one-process reference counts through it in this process), as forks of one
interpreter that imported what it imports (_ForkServer, below).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest

import many_processes_reads
import support
import test_multihost as mh  # Its process helpers: environment, start, deadline, kill.

import dist_ens

# A tiny run (support.config with 8 members of a (8,) MLP, batch 32, 4 steps), as the
# config of the one-process reference and as flags for local.sh.
TINY = {'num_members': 8, 'model.widths': (8,), 'data.batch_size': 32, 'train.steps': 4,
        'train.log_every': 2, 'train.eval_every': 0, 'eval.joint_tau': 0,
        'checkpoint.every': 4, 'writers': ('jsonl',)}
BATCH = TINY['data.batch_size']
# Each layout with 4 processes, and the block of the one-process batch that process p
# reads: [K, B] for the shared order, [K, M, B] for a per-member one (K steps a call).
LAYOUTS = {
    # One 'data' position per process: host p feeds rows [8p, 8p + 8) of the shared batch.
    'data': ({'mesh.member': 2, 'mesh.data': 4, 'mesh.hosts_along': 'data'},
             lambda p: (slice(None), slice(8 * p, 8 * p + 8))),
    # Two members per process, each member its own order: host p feeds every row of
    # members 2p and 2p + 1, and nothing of the others.
    'member': ({'mesh.member': 4, 'mesh.data': 2, 'mesh.hosts_along': 'member',
                'data.member_order': 'shuffled'},
               lambda p: (slice(None), slice(2 * p, 2 * p + 2), slice(None))),
}


# The read-counting runs' processes, as `python tests/many_processes_reads.py -m
# dist_ens.main FLAGS` runs each, for the price of one interpreter's imports. local.sh
# starts each process as it starts any (its env, flags, timeout, output prefix and exit
# status), but the Python it runs ($PYTHON) is _FORK_CLIENT, which hands its argv, env,
# working directory and stdin/stdout/stderr to _FORK_SERVER and waits. The server has
# imported what the script and its training import (JAX, dist_ens's modules) without
# starting a JAX backend, and forks a process for each request that runs the script as
# __main__ in that env (XLA reads XLA_FLAGS, and with it the process's device count, when
# the fork's backend starts). The client passes SIGTERM and SIGINT on to its fork and exits
# with its status; the server kills a fork whose client went away (local.sh's --timeout)
# and every fork when its own stdin closes. Each process took 5.0-5.2 CPU s fresh and
# 3.5-3.9 forked (the server's imports: 1.8-2.1 once). gc.freeze(): without it each fork's
# collections touch, and so copy, every page of the imported objects, and it took as long
# as a fresh process. A fresh interpreter starting dist_ens.main through local.sh:
# test_multihost's runs and this file's slow tests.
_FORK_SERVER = r"""
import gc, json, os, runpy, select, signal, socket, sys, threading
address, script = '\0' + sys.argv[1], sys.argv[2]  # Linux's abstract namespace.
sys.path[0] = os.path.dirname(script)  # As `python script` has it.
import jax
import dist_ens
from dist_ens import main
import many_processes_reads
dist_ens.train, dist_ens.Ensemble, main.entry  # Their modules (PEP 562).
from jax._src import xla_bridge
assert not xla_bridge._backends, 'a backend started before the fork: XLA_FLAGS would be read'
assert threading.active_count() == 1, threading.enumerate()  # Nothing held across a fork.
gc.freeze()
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.bind(address)
server.listen(16)
forks = {}  # The client's connection: its fork's pid.
while True:
  for client, pid in list(forks.items()):  # Each ended fork's status to its client.
    ended, status = os.waitpid(pid, os.WNOHANG)
    if ended:
      try:
        client.send(str(os.waitstatus_to_exitcode(status)).encode())
      except OSError:  # The client went away (and so the fork was killed).
        pass
      client.close()
      del forks[client]
  ready, _, _ = select.select([server, sys.stdin, *forks], [], [], 0.05)
  if sys.stdin in ready and not sys.stdin.readline():
    break
  for client in ready:
    if client in forks:  # Its client went away before it ended: so does the fork.
      os.kill(forks[client], signal.SIGKILL)
  if server in ready:
    client, _ = server.accept()
    request, fds, _, _ = socket.recv_fds(client, 1 << 20, 3)
    request = json.loads(request)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # From here on as `python script ARGV` runs it, in the client's env.
      for sock in (server, client, *forks):
        sock.close()
      for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
      os.environ.clear()
      os.environ.update(request['env'])
      os.chdir(request['cwd'])
      sys.argv = [script, *request['argv']]
      runpy.run_path(script, run_name='__main__')
      sys.exit(0)
    for fd in fds:
      os.close(fd)
    client.send(str(pid).encode())
    forks[client] = pid
for pid in forks.values():
  os.kill(pid, signal.SIGKILL)
"""
# The Python local.sh runs for each process: `python -S` (stdlib only, a fresh interpreter
# in hundredths of a second) with the server's socket name and the process's argv.
_FORK_CLIENT = r"""
import json, os, signal, socket, sys, time
address, argv = '\0' + sys.argv[1], sys.argv[2:]
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
deadline = time.monotonic() + 120  # The server's imports, on a loaded machine.
while True:
  try:
    server.connect(address)
    break
  except ConnectionRefusedError:  # Not bound yet.
    if time.monotonic() > deadline:
      sys.exit(f'no fork server at {address!r} after 120 s')
    time.sleep(0.02)
request = {'argv': argv, 'env': dict(os.environ), 'cwd': os.getcwd()}
socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
pid = int(server.recv(64) or sys.exit('the fork server went away'))
for number in (signal.SIGTERM, signal.SIGINT):
  signal.signal(number, lambda number, frame: os.kill(pid, number))
status = int(server.recv(64) or sys.exit('the fork server went away'))
if status < 0:  # The fork ended by a signal: so does its stand-in.
  if -status in (signal.SIGTERM, signal.SIGINT):
    signal.signal(-status, signal.SIG_DFL)
  os.kill(os.getpid(), -status)
sys.exit(status)
"""


class _ForkServer:
  """_FORK_SERVER in a session of its own, with `env` (local.sh's, less what it adds per
  process); .python: the executable to give local.sh as $PYTHON."""

  def __init__(self, folder: Path, env: dict[str, str]):
    folder.mkdir(parents=True, exist_ok=True)
    self.log = folder / 'fork_server.log'
    # A socket in Linux's abstract namespace: no file, and no limit of 108 bytes on the
    # path of pytest's tmp folders.
    name = f'dist_ens_test_forks_{uuid.uuid4().hex}'
    client = folder / 'fork_client.py'
    client.write_text(_FORK_CLIENT)
    self.python = folder / 'python'
    # local.sh's other use of $PYTHON (-c: its free port) goes to Python itself.
    exe = shlex.quote(sys.executable)
    self.python.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {exe} "$@"; fi\n'
                           f'exec {exe} -S {shlex.quote(str(client))} {name} "$@"\n')
    self.python.chmod(0o755)
    with self.log.open('w') as log:
      self.process = subprocess.Popen(
          [sys.executable, '-c', _FORK_SERVER, name, many_processes_reads.__file__],
          env={**env, 'JAX_PLATFORMS': 'cpu'}, cwd=mh.ROOT, stdin=subprocess.PIPE, stdout=log,
          stderr=subprocess.STDOUT, start_new_session=True)

  def close(self) -> str:
    """Ends the server (its stdin closed; killed with any fork left after 30 s) and returns
    what it said."""
    self.process.stdin.close()
    try:
      self.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
      pass
    mh._kill_session(self.process)
    self.process.wait()
    return self.log.read_text()


def _env(reads_dir: Path | None = None) -> dict[str, str]:
  """The env of local.sh on TINY's runs: they compile as the tests do (support.FAST_COMPILE);
  with `reads_dir`, each process counts what its input pipeline reads there."""
  extra = {'XLA_FLAGS': ' '.join(support.FAST_COMPILE)}
  if reads_dir is not None:
    reads_dir.mkdir(parents=True, exist_ok=True)
    extra[many_processes_reads.READS_DIR] = str(reads_dir)
  return mh._env(devices=None, **extra)


def _flags(fields: dict) -> list[str]:
  return [f'--config.{k}={v if isinstance(v, str) else repr(v)}' for k, v in fields.items()]


def _local_sh(workdir: Path, processes: int, devices: int, fields: dict,
              env: dict[str, str], timeout_s: int = 240) -> subprocess.Popen:
  """launch/local.sh on TINY | fields, with `env` (_env's)."""
  return mh._start(['bash', str(mh.LOCAL_SH), '--processes', str(processes),
                    '--devices-per-process', str(devices), '--timeout', str(timeout_s),
                    '--grace', '60', '--kill-after', '15', '--', mh.CONFIG,
                    f'--workdir={workdir}', *_flags({**TINY, **fields})], env)


def _reads(out_dir: Path) -> list[dict]:
  return [json.loads(p.read_text())
          for p in sorted(out_dir.glob('reads_*.json'), key=lambda p: int(p.stem[6:]))]


def _assert_same_metrics(got: dict, want: dict) -> None:
  # The tolerance of test_multihost's two-process comparisons: the same mesh computes
  # the same shards; only where its collectives run differs (a summation order at most).
  for metric in ('nll', 'accuracy', 'brier', 'ece'):
    np.testing.assert_allclose(got['members'][metric], want['members'][metric], atol=1e-6,
                               err_msg=metric)
  assert abs(got['ensemble']['nll'] - want['ensemble']['nll']) < 1e-6


@pytest.mark.parametrize('hosts_along', ['data', pytest.param('member', marks=pytest.mark.slow)])
def test_four_processes_match_one_and_each_reads_only_its_block(tmp_path, monkeypatch,
                                                                 hosts_along):
  fields, block_of = LAYOUTS[hosts_along]
  env = _env(tmp_path / 'reads')
  forks = _ForkServer(tmp_path / 'forks', env)
  # The four processes start first: the reference trains here while the server imports
  # and they meet, instead of before they start. Both are bounded: _wait kills the four at
  # 240 s.
  launcher = _local_sh(tmp_path / 'w', 4, 2, fields, {**env, 'PYTHON': str(forks.python)})
  try:
    many_processes_reads.count_reads(tmp_path / 'one', monkeypatch.setattr)
    (tmp_path / 'one').mkdir()
    one = dist_ens.train(support.config({**TINY, **fields}), str(tmp_path / 'one' / 'w'))
    [(status, out)] = mh._wait([launcher], 240)
  finally:
    if launcher.poll() is None:
      mh._kill_session(launcher)
    said = forks.close()
  assert status == 0, out[-5000:] + said
  assert forks.process.returncode == 0, said  # It ended when asked, not killed.
  assert re.search(r'^\[3\] .*\[process 3\] step 4/4', out, re.M), out[-3000:]
  for p in range(4):  # Each fork started its own backend, on the devices local.sh gave it.
    assert re.search(rf'^\[{p}\] .*started: process {p} of 4, 2 local / 8 global devices', out,
                     re.M), out[-3000:]
  _assert_same_metrics(json.loads((tmp_path / 'w' / 'final_metrics.json').read_text()), one)

  [whole] = _reads(tmp_path / 'one')
  lead = (-1, BATCH) if hosts_along == 'data' else (-1, TINY['num_members'], BATCH)
  first = np.asarray(whole['first']).reshape(lead)
  per_process = _reads(tmp_path / 'reads')
  assert len(per_process) == 4
  for p, reads in enumerate(per_process):
    # Its block of the batch the one process read, and a quarter of its bytes, every step.
    np.testing.assert_array_equal(reads['first'], first[block_of(p)].ravel(), err_msg=p)
    assert set(reads['rows']) == {whole['rows'][0] // 4}, (p, reads['rows'])
    assert set(reads['bytes']) == {whole['bytes'][0] // 4}, (p, reads['bytes'])
    assert reads['examples'] == sum(reads['rows'])  # What Batches.stats reports.



def _params(workdir: Path) -> list[np.ndarray]:
  return [np.asarray(leaf) for leaf in jax.tree.leaves(dist_ens.Ensemble.load(workdir).params)]


@pytest.mark.slow
def test_eight_processes_checkpoint_and_four_resume_exactly(tmp_path):
  """8 x 1 devices train 4 steps and save; 4 x 2 resume to 8: as one process, 8 steps."""
  layout = {'mesh.member': 8, 'mesh.data': 1}  # Hosts along 'member': 1, then 2 members each.
  for processes, devices, steps in ((8, 1, 4), (4, 2, 8)):
    [(status, out)] = mh._wait([_local_sh(tmp_path / 'w', processes, devices,
                                          {**layout, 'train.steps': steps}, _env())], 300)
    assert status == 0, out[-5000:]
    last = processes - 1
    assert re.search(rf'^\[{last}\] .*\[process {last}\] step {steps}/{steps}', out,
                     re.M), out[-3000:]
  for p in range(4):  # Every process of the second run restored the first's checkpoint.
    assert re.search(rf'^\[{p}\] .*resuming from the checkpoint at step 4$', out, re.M), out[-3000:]
  config = support.config({**TINY, **layout, 'train.steps': 8})
  whole = dist_ens.train(config, str(tmp_path / 'whole'))
  _assert_same_metrics(json.loads((tmp_path / 'w' / 'final_metrics.json').read_text()), whole)
  # Bit for bit: with mesh.data=1 no collective sums anything, so no order can differ.
  for got, want in zip(_params(tmp_path / 'w'), _params(tmp_path / 'whole'), strict=True):
    np.testing.assert_array_equal(got, want)


def _wait_for_step(launcher: subprocess.Popen, lines: list[str], pattern: str,
                   timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while not any(re.search(pattern, line) for line in list(lines)):
    if time.monotonic() > deadline or launcher.poll() is not None:
      mh._kill_session(launcher)
      pytest.fail(f'no {pattern!r}:\n' + ''.join(lines[-50:]))
    time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_each_of_eight_processes_saves_at_one_step(tmp_path):
  """As a scheduler preempting a slice: SIGTERM to every process, not to the launcher."""
  launcher = _local_sh(tmp_path / 'w', 8, 1, {'mesh.member': 8, 'mesh.data': 1,
                                              'train.steps': 100000, 'checkpoint.every': 50},
                       _env(), timeout_s=240)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
  reader.start()
  _wait_for_step(launcher, lines, r'^\[7\] .*\[process 7\] step 10/', 200)
  pids = [mh._python_pid_of(launcher, i) for i in range(8)]
  assert None not in pids, ''.join(lines[-50:])
  for pid in pids:
    os.kill(pid, signal.SIGTERM)
  status, out = mh._wait_launcher(launcher, lines, reader, 120)
  assert status == 143, out[-3000:]  # Each process's status, passed on by local.sh.
  saved = re.findall(r'^\[(\d)\] .*preempted \(SIGTERM\): saved the checkpoint at step (\d+)',
                     out, re.M)
  assert sorted(p for p, _ in saved) == [str(i) for i in range(8)], out[-3000:]
  [step] = {int(s) for _, s in saved}
  assert step >= 10, step
  meta = tmp_path / 'w' / 'checkpoints' / str(step) / 'meta' / 'metadata'
  assert json.loads(meta.read_text())['step'] == step
  assert 'Traceback' not in out, out[-3000:]
