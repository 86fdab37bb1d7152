"""Jobs each in a process of its own, for the price of one interpreter's imports.

A test that needs many short processes (command lines that refuse, a tiny run) starts one
child interpreter with `answers(script, jobs, ...)`. The script imports what the jobs share
(dist_ens's command modules, JAX) and defines `run(job, prefix)`; `fork_each(run)` then
forks a process per job, with stdout and stderr in files, a time limit, and the exit
status Python gives an uncaught SystemExit. Each fork is a fresh process but for those
imports, so the script's own output must be empty (checked): a fresh process would print
it first. What a fork does not reproduce is a product module that reaches a submodule it
does not import, loaded here by another; the tests that start fresh interpreters (the
trainings of test_cli, test_multihost's runs) would fail on that.
"""

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Answer(NamedTuple):
  """What a process answered: its exit status, stdout and stderr."""
  returncode: int
  stdout: str
  stderr: str


def dist_ens_main(args: list[str]) -> None:
  """Runs dist_ens.main as __main__ with `args`, as `python -m dist_ens.main ARGS` does."""
  sys.argv = ['dist_ens/main.py', *args]  # runpy puts the module's path first, as -m does.
  runpy.run_module('dist_ens.main', run_name='__main__', alter_sys=True)


def fork_each(run: Callable[[object, str], None]) -> None:
  """In the child interpreter (argv: its folder, the limit in s): run(job, prefix) for each
  job of the folder's jobs.json in a fork, whose stdout and stderr go to prefix.stdout and
  prefix.stderr; each fork's exit status goes to statuses.json."""
  out, limit_s = sys.argv[1], int(sys.argv[2])
  with open(os.path.join(out, 'jobs.json')) as f:
    jobs = json.load(f)
  statuses = []
  for i, job in enumerate(jobs):
    sys.stdout.flush()
    sys.stderr.flush()
    prefix = os.path.join(out, str(i))
    pid = os.fork()
    if pid == 0:  # The job's process: it ends as Python ends, by exit or by an exception.
      for fd, stream in ((1, 'stdout'), (2, 'stderr')):
        os.dup2(os.open(f'{prefix}.{stream}', os.O_WRONLY | os.O_CREAT), fd)
      signal.alarm(limit_s)
      run(job, prefix)
      sys.exit(0)
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
  with open(os.path.join(out, 'statuses.json'), 'w') as f:
    json.dump(statuses, f)


def answers(script: str, jobs: list, out: Path, env: dict[str, str],
            limit_s: int) -> list[tuple[Answer, str]]:
  """(answer, prefix) of each job, run by `script` (which ends with fork_each(run)) in
  one child interpreter started in the repository with `env`; `out` is a new folder."""
  out.mkdir()
  (out / 'jobs.json').write_text(json.dumps(jobs))
  prelude = f'import sys\nsys.path.insert(0, {str(ROOT / "tests")!r})\n'
  child = subprocess.run([sys.executable, '-c', prelude + script, str(out), str(limit_s)],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=limit_s + 30)
  # Nothing on its own stdout or stderr: the imports a fresh process makes print nothing.
  assert child.returncode == 0 and not child.stdout and not child.stderr, child.stderr
  statuses = json.loads((out / 'statuses.json').read_text())
  assert len(statuses) == len(jobs), statuses
  return [(Answer(status, (out / f'{i}.stdout').read_text(), (out / f'{i}.stderr').read_text()),
           str(out / str(i))) for i, status in enumerate(statuses)]
