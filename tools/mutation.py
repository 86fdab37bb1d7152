"""Mutation kill rates of modules with pure logic (issue 64 item 5).

  .venv/bin/python tools/mutation.py [--repo PATH] [--modules rng,pipeline,orders,metrics]
                                     [--sample NAME=N,...] [--out FILE]

Measures the share of mutants of each module in MODULES that its fast-tier tests kill,
with mutmut (pinned below), and writes benchmarks/results/mutation.json plus a table.

What it does, so that a figure can be measured again on another commit:
  - Clones the HEAD of --repo (default: the repository this file is in) into --work: the
    mutants are made from that commit, never from a working tree someone is editing.
    Uncommitted changes are not measured; the commit is recorded.
  - Makes tools/.venv-mutation (git-ignored) on first use: a venv holding mutmut only, that
    sees the project's installed packages (jax, pytest, ...) through a .pth line naming the
    site-packages of the Python running this script. Run it with the project's venv. The
    package itself is not installed there: the tests import the mutated copy mutmut writes
    under <clone>/mutants/ (mutmut stops if they import it from anywhere else).
  - Per module: writes the [mutmut] section of the clone's setup.cfg, runs `mutmut run` on
    the module's mutants (SCOPE: the functions of pure logic) against the module's TEST
    FILES, each run bounded by `timeout`. mutmut first runs those files once unmutated
    (recording which test calls which function), checks they pass, checks a mutant that
    raises everywhere is caught, then runs each mutant against only the tests (of those
    files) that called the mutated function, stopping at the first failure.

Test files per module: the fast-tier files that test the module's functions by calling them
(a grep of tests/ for their names and for imports of the module; see MODULES): the whole
fast tier per mutant would take ~10 minutes each. The slow tier is left out (pyproject's
`-m 'not slow'`). So the figure is a lower bound on what the whole fast tier kills: an
end-to-end test in another file may kill a mutant these files miss.

Kill rate = (killed + timeout) / mutants. A mutant that no test of the files calls ('no
tests') counts as surviving; mutmut mutates function bodies only (module constants such
as rng's stream tags are not mutated).

--sample metrics=N runs every Nth mutant of a module's scope (sorted by function and mutmut's
number) when the time for all of them is not there; the JSON says so.
"""

import argparse
import datetime
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

MUTMUT = 'mutmut==3.8.1'
HERE = Path(__file__).resolve().parent

# name: (module file, mutant-name globs in scope (relative to the module), test files).
MODULES = {
    'rng': ('dist_ens/core/rng.py', ('*',),
            # The files that import dist_ens.core.rng or call member_keys / fresh_keys /
            # train_key.
            ('tests/test_ensemble.py', 'tests/test_pretrained.py', 'tests/test_prior.py',
             'tests/test_adapters.py')),
    'pipeline': ('dist_ens/data/pipeline.py',
                 # The batch orders and per-host slices; Batches / BatchIterator /
                 # to_global (threads and device transfers) are left out.
                 ('xǁOrderǁ*', 'x_host_block__mutmut_*', 'x_local_indices__mutmut_*'),
                 # test_data.py tests Order, host_block and local_indices by name;
                 # test_member_split.py the orders over member pools (Order's pools);
                 # test_orders.py the orders' properties as pure functions (issue 64).
                 ('tests/test_data.py', 'tests/test_member_split.py', 'tests/test_orders.py')),
    'orders': ('dist_ens/data/orders.py', ('*',),
               # The per-member orders' arithmetic: test_orders.py checks them against
               # their definition in Python integers, numpy's against XLA's, and their
               # statistics.
               ('tests/test_orders.py',)),
    'metrics': ('dist_ens/eval/metrics.py', ('*',),
                # The files that call eval_batch / ensemble_log_probs / member_uncertainty
                # / add_sums through `from dist_ens.eval import metrics`.
                ('tests/test_metrics.py', 'tests/test_evaluate.py',
                 'tests/test_shift_eval.py')),
}

# mutmut's exit codes (mutmut/stats.py), folded into the columns reported.
STATUS = {1: 'killed', 3: 'killed', 0: 'survived', 5: 'no_tests', 33: 'no_tests',
          36: 'timeout', 24: 'timeout', -24: 'timeout', 152: 'timeout', 255: 'timeout',
          -9: 'segfault', -11: 'segfault', 37: 'killed', 34: 'skipped', None: 'not_checked'}


def sh(cmd, cwd=None, timeout=600, env=None, check=True):
  """Runs cmd bounded by `timeout -k 10 N`; returns the completed process."""
  proc = subprocess.run(['timeout', '-k', '10', str(timeout), *map(str, cmd)], cwd=cwd,
                        env=env, text=True, capture_output=True)
  if check and proc.returncode:
    raise SystemExit(f'{" ".join(map(str, cmd))} failed ({proc.returncode}):\n'
                     f'{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}')
  return proc


def ensure_venv(venv: Path) -> Path:
  """tools/.venv-mutation with mutmut, seeing this Python's site-packages."""
  python = venv / 'bin' / 'python'
  site = sysconfig.get_paths()['purelib']
  try:
    import jax, pytest  # noqa: F401  pylint: disable=import-outside-toplevel,multiple-imports
  except ImportError:
    raise SystemExit('Run this with the project venv\'s Python (it needs jax and pytest).')
  if not python.exists():
    sh([sys.executable, '-m', 'venv', venv], timeout=300)
    sh([python, '-m', 'pip', 'install', '-q', MUTMUT], timeout=600)
  own_site = sh([python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                timeout=60).stdout.strip()
  # Appended after the venv's own packages: mutmut's pins win, the project's fill in.
  Path(own_site, 'zz_project_site.pth').write_text(site + '\n')
  return venv / 'bin' / 'mutmut'


def mutant_names(python: Path, clone: Path, module: str) -> list[str]:
  """Every mutant mutmut makes of `module` (full names), in function then number order."""
  code = ('import os, sys, json; os.environ["MUTANT_UNDER_TEST"] = "mutant_generation"\n'
          'from mutmut.mutation.file_mutation import mutate_file_contents\n'
          'f = sys.argv[1]; print(json.dumps(list(mutate_file_contents(f, open(f).read())'
          '.mutant_names)))')
  names = json.loads(sh([python, '-c', code, module], cwd=clone, timeout=120).stdout)
  dotted = module[:-len('.py')].replace('/', '.')

  def key(name):
    head, _, number = name.rpartition('__mutmut_')
    return head, int(number)

  return [f'{dotted}.{n}' for n in sorted(names, key=key)]


def write_config(clone: Path, module: str, tests: tuple[str, ...], debug: bool) -> None:
  top = sorted({p.split('/')[0] for p in sh(['git', 'ls-files'], cwd=clone).stdout.split()}
               - {'dist_ens', 'tests', 'pyproject.toml', '.gitignore', '.ci', 'setup.cfg'})
  lines = ['[mutmut]', 'source_paths = dist_ens', f'only_mutate = {module}',
           # The tests read configs/, examples/, ... relative to the repository root.
           'also_copy =', *(f'    {p}' for p in top),
           # One process per test run; the fast tier only (pyproject's addopts).
           'pytest_add_cli_args =', '    -p', '    no:cacheprovider', '    -n', '    0',
           'pytest_add_cli_args_test_selection =', *(f'    {t}' for t in tests),
           # jax is not fork-safe once it has run: fork each mutant from a server that has
           # imported nothing, never from the process that ran the tests.
           'process_isolation = forkserver', 'forkserver_warmup = none',
           'use_git_change_detection = false', f'debug = {str(debug).lower()}', '']
  (clone / 'setup.cfg').write_text('\n'.join(lines))


def show(mutmut: Path, clone: Path, name: str) -> str:
  out = sh([mutmut, 'show', name], cwd=clone, timeout=120, check=False).stdout
  return '\n'.join(l for l in out.splitlines()
                   if l[:1] in '+-' and not l.startswith(('+++', '---')))


def measure(name: str, clone: Path, mutmut: Path, args) -> dict:
  module, scope, tests = MODULES[name]
  python = mutmut.parent / 'python'
  shutil.rmtree(clone / 'mutants', ignore_errors=True)
  write_config(clone, module, tests, args.debug)
  every = mutant_names(python, clone, module)
  dotted = module[:-len('.py')].replace('/', '.') + '.'
  in_scope = [m for m in every if any(fnmatch.fnmatchcase(m[len(dotted):], g) for g in scope)]
  sample = args.sample.get(name, 1)
  chosen = in_scope[::sample]
  print(f'{name}: {len(chosen)} of {len(in_scope)} mutants in scope ({len(every)} in the '
        f'file), tests: {" ".join(tests)}', flush=True)
  start = time.time()
  log = args.work / f'mutmut-{name}.log'
  proc = sh([mutmut, 'run', '--max-children', args.max_children, *chosen], cwd=clone,
            timeout=args.timeout, check=False)
  wall = time.time() - start
  log.write_text(proc.stdout + proc.stderr)
  meta_path = clone / 'mutants' / (module + '.meta')
  if not meta_path.exists():
    raise SystemExit(f'mutmut made no results for {name} (rc {proc.returncode}); see {log}')
  codes = json.loads(meta_path.read_text())['exit_code_by_key']
  status = {m: STATUS.get(codes.get(m), 'suspicious') for m in chosen}
  count = {s: sum(v == s for v in status.values())
           for s in ('killed', 'survived', 'timeout', 'no_tests', 'suspicious', 'segfault',
                     'not_checked')}
  if count['not_checked']:
    print(f'  {count["not_checked"]} mutants not checked (rc {proc.returncode}, the '
          f'{args.timeout} s limit?); see {log}', flush=True)
  checked = len(chosen) - count['not_checked']
  killed = count['killed'] + count['timeout']
  survivors = [m for m, s in status.items() if s in ('survived', 'no_tests')]
  return {
      'module': module,
      'scope': list(scope),
      'test_files': list(tests),
      'mutants_in_scope': len(in_scope),
      'mutants': checked,
      'sample_every': sample,
      'killed': count['killed'],
      'timeouts': count['timeout'],
      'survived': count['survived'],
      'no_tests': count['no_tests'],
      'suspicious': count['suspicious'] + count['segfault'],
      'not_checked': count['not_checked'],
      'kill_rate': round(killed / checked, 4) if checked else None,
      'wall_s': round(wall),
      'survivors': {m[len(dotted):]: {'status': status[m], 'diff': show(mutmut, clone, m)}
                    for m in survivors},
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repo', type=Path, default=HERE.parent,
                      help='repository whose HEAD is measured (default: this one)')
  parser.add_argument('--work', type=Path, default=None,
                      help='scratch folder for the clone (default /tmp/mutation-<commit>)')
  parser.add_argument('--modules', default=','.join(MODULES))
  parser.add_argument('--sample', default='',
                      help='NAME=N,...: run every Nth mutant of module NAME (default: all)')
  parser.add_argument('--max-children', type=int, default=2)
  parser.add_argument('--timeout', type=int, default=3600, help='seconds per module')
  parser.add_argument('--venv', type=Path, default=HERE / '.venv-mutation')
  parser.add_argument('--out', type=Path, default=None,
                      help='default: benchmarks/results/mutation.json of --repo')
  parser.add_argument('--debug', action='store_true', help='mutmut prints each pytest run')
  args = parser.parse_args(argv)
  args.sample = {k: int(v) for k, v in (p.split('=') for p in args.sample.split(',') if p)}
  repo = args.repo.resolve()
  commit = sh(['git', 'rev-parse', 'HEAD'], cwd=repo).stdout.strip()
  args.work = (args.work or Path(f'/tmp/mutation-{commit[:12]}')).resolve()
  out = args.out or repo / 'benchmarks' / 'results' / 'mutation.json'
  mutmut = ensure_venv(args.venv)
  clone = args.work / 'clone'
  shutil.rmtree(clone, ignore_errors=True)
  args.work.mkdir(parents=True, exist_ok=True)
  sh(['git', 'clone', '-q', repo, clone], timeout=300)
  sh(['git', 'checkout', '-q', commit], cwd=clone)
  results = json.loads(out.read_text()) if out.exists() else {}
  results.setdefault('runs', [])
  run = {'commit': commit, 'date': datetime.date.today().isoformat(), 'tool': MUTMUT,
         'command': ' '.join(['python', 'tools/mutation.py', *(argv or sys.argv[1:])]),
         'cpus': os.cpu_count(), 'modules': {}}
  if results['runs'] and results['runs'][-1]['commit'] == commit:
    # The same commit measured again (some modules, say): its modules' rows are replaced.
    run['modules'] = results['runs'][-1]['modules']
    run['command'] = results['runs'][-1]['command'] + ' && ' + run['command']
    results['runs'][-1] = run
  else:
    results['runs'].append(run)
  out.parent.mkdir(parents=True, exist_ok=True)
  for name in args.modules.split(','):
    run['modules'][name] = measure(name, clone, mutmut, args)
    print(f'  {table_row(name, run["modules"][name])}', flush=True)
    # Written after each module, so a run cut short keeps what it measured.
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + '\n')
  print(f'\ncommit {commit[:12]}, {run["date"]}, {MUTMUT}\n{HEADER}')
  for name, row in run['modules'].items():
    print(table_row(name, row))
  print(f'written to {out}')


HEADER = (f'{"module":<10}{"mutants":>8}{"killed":>8}{"timeout":>8}{"survived":>9}'
          f'{"no tests":>9}{"kill rate":>10}{"wall s":>8}')


def table_row(name, r):
  rate = '-' if r['kill_rate'] is None else f'{100 * r["kill_rate"]:.1f}%'
  return (f'{name:<10}{r["mutants"]:>8}{r["killed"]:>8}{r["timeouts"]:>8}{r["survived"]:>9}'
          f'{r["no_tests"]:>9}{rate:>10}{r["wall_s"]:>8}')


if __name__ == '__main__':
  main()
