"""tools/architecture.py measures what it says, on a package written here (its figures for
dist_ens itself are in docs/how-it-works.md)."""

import support


def _tool():
  return support.load_tool('architecture')


def _package(tmp_path, files):
  """A package named dist_ens under tmp_path holding `files` (path -> text)."""
  package = tmp_path / 'dist_ens'
  for name, text in files.items():
    (package / name).parent.mkdir(parents=True, exist_ok=True)
    (package / name).write_text(text)
  return package


def test_it_counts_root_modules_cycles_raw_configs_and_group_mentions(tmp_path):
  files = {
      '__init__.py': 'from dist_ens import a\n',
      'a.py': 'from dist_ens import b\nimport ml_collections\n',
      'b.py': 'def f():\n  from dist_ens import a  # a circle, however hidden\n',
      'core/__init__.py': '',
      'core/step.py': 'from dist_ens import b\nx = parts.groups\n',  # climbs a layer
  }
  package = _package(tmp_path, files)
  found = _tool().measure(package)
  assert found['modules'] == 5 and found['root_modules'] == 3
  assert found['lines'] == sum(t.count('\n') for t in files.values())
  assert found['import_cycles'] == [['dist_ens.a', 'dist_ens.b']]
  assert found['raw_config'] == ['dist_ens.a']
  assert found['member_groups'] == ['dist_ens.core.step']
  assert found['back_arrows'] == ['dist_ens.core.step -> dist_ens.b']


def test_an_import_of_a_groups_module_counts_under_any_name(tmp_path):
  # An alias must not hide that a module uses the groups' own code.
  files = {
      '__init__.py': '',
      'evaluators/laplace.py': 'from dist_ens.evaluators import groups as stacks, posthoc\n',
      'evaluators/registry.py': 'from dist_ens.evaluators import (greedy,\n    groups)\n',
      'plan/planner.py': 'from dist_ens.plan import dry_run, groups_plan\n',
      'run/assemble.py': 'import dist_ens.config.groups as g\n',
      'evaluators/posthoc.py': 'def stack_ensembles(places):\n  return [p.ids for p in places]\n',
  }
  found = _tool().measure(_package(tmp_path, files))['member_groups']
  assert found == ['dist_ens.evaluators.laplace', 'dist_ens.evaluators.registry',
                   'dist_ens.plan.planner', 'dist_ens.run.assemble']


def test_a_circle_through_a_packages_init_counts_and_type_checking_imports_do_not(tmp_path):
  # evaluators/posthoc imported training.loop; training/__init__ imported trainer, which
  # imported posthoc back: `import dist_ens.evaluators.posthoc` alone failed.
  files = {
      '__init__.py': '',
      'training/__init__.py': 'from dist_ens.training.trainer import train\n',
      'training/loop.py': '',
      'training/trainer.py': 'from dist_ens.evaluators import posthoc\n',
      'evaluators/__init__.py': '',
      'evaluators/posthoc.py': 'from dist_ens.training.loop import Call\n',
      # The same shape with the package's import for type checkers only: no circle.
      'lazy/__init__.py': ('from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                           '  from dist_ens.lazy.top import f\n'),
      'lazy/top.py': 'from dist_ens import user\n',
      'lazy/leaf.py': '',
      'user.py': 'from dist_ens.lazy import leaf\n',
  }
  package = _package(tmp_path, files)
  assert _tool().measure(package)['import_cycles'] == [
      ['dist_ens.evaluators.posthoc', 'dist_ens.training', 'dist_ens.training.trainer']]


def test_config_readers_below_the_edge_are_the_ones_that_read_fields_or_pass_a_config_on(
    tmp_path):
  files = {
      '__init__.py': '',
      'config/__init__.py': '',
      'config/defaults.py': 'def get_config(config):\n  config.seed = 0\n  config.eval = 1\n',
      'config/specs.py': 'def spec(config):\n  return config.seed\n',  # the edge may
      'training/__init__.py': '',
      'training/loop.py': 'def f(session):\n  return session.config.eval.batch_size\n',
      'training/pbt.py': 'def f(session):\n  return g(session.config)\n',  # passed on
      'training/typed.py': 'def f(config: "ml_collections.ConfigDict"):\n  pass\n',
      'training/clean.py': 'def f(session):\n  return session.spec.seed\n',
      # Another object named config with other fields (a Hugging Face model's).
      'models/__init__.py': '',
      'models/hf.py': 'def f(config):\n  return config.hidden_size\n',
  }
  package = _package(tmp_path, files)
  found = _tool().measure(package)
  assert found['config_readers'] == ['dist_ens.config.defaults', 'dist_ens.config.specs',
                                     'dist_ens.training.loop', 'dist_ens.training.pbt',
                                     'dist_ens.training.typed']
  assert found['config_below'] == ['dist_ens.training.loop', 'dist_ens.training.pbt',
                                   'dist_ens.training.typed']


def test_the_files_one_step_needs_are_the_ones_its_tracing_enters():
  files = _tool().step_files(support.ROOT / 'configs' / 'default.py')
  step = files['step']
  # The step's own module and the default model's, in the order first entered; none of
  # the harness (plan/dry_run.py) nor of what runs around a step (the loop, the pipeline).
  assert step[0] == 'dist_ens/run/assemble.py' and 'dist_ens/core/step.py' in step
  assert 'dist_ens/models/mlp.py' in step and 'dist_ens/plan/dry_run.py' not in step
  assert not [f for f in step if f.startswith(('dist_ens/training/', 'dist_ens/data/pipe'))]
  assert len(set(step)) == len(step) and 'dist_ens/config/specs.py' in files['wiring']

