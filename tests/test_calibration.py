"""`dist-ens plan --calibrate` (dist_ens.plan.calibration): times every member form
side by side, caches the fastest, and member_parallelism='auto' then uses it for runs of
the same shape only; an explicit form is never overridden."""

from pathlib import Path

import jax
import pytest

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens.run import member_forms
from dist_ens.run import assemble
from dist_ens.plan import calibration

DEFAULT = Path(__file__).parent.parent / 'configs' / 'default.py'


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / 'calibration.json'
  monkeypatch.setenv(calibration.CACHE_ENV, str(path))
  return path


def _parts(members=4, parallelism='auto', batch=32):
  config = dist_ens.load_config(DEFAULT)
  config.num_members, config.model.widths, config.data.batch_size = members, (16,), batch
  config.mesh.member, config.mesh.data = 1, 1
  config.ensemble.member_parallelism = parallelism
  return assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]), (40, 1),
                              10)


def test_time_forms_rotates_the_forms_and_leaves_compilation_out():
  now, calls = [0.0], []
  cost = {('vmap', None): 3.0, ('map', None): 2.0, ('map', 2): 1.0}

  def run_step(form):
    first = [True]

    def run():
      calls.append(form)
      now[0] += 100.0 if first[0] else cost[form]  # The first call compiles.
      first[0] = False

    return run

  seconds = calibration.time_forms(run_step, list(cost), steps=2, rounds=3,
                                   clock=lambda: now[0])
  assert seconds == cost
  timed = calls[len(cost):]  # After one compiling call each: rounds of every form in turn.
  assert timed == [f for _ in range(3) for f in cost for _ in range(2)]


def test_the_cached_form_drives_auto_for_the_same_shape_only(cache, monkeypatch):
  measured = {('vmap', None): 3.0, ('map', None): 2.0, ('map', 2): 1.0}
  monkeypatch.setattr(calibration, 'time_forms', lambda *a, **k: measured)
  parts = _parts()
  assert member_forms.member_form(parts, 32) == ('vmap', None)  # The CPU rule for an MLP.
  best, _ = calibration.calibrate(parts, 32)
  assert best == ('map', 2) and cache.exists()
  assert member_forms.member_form(parts, 32) == ('map', 2)
  assert member_forms.member_form(_parts(), 32) == ('map', 2)  # A new build of the same run.
  assert member_forms.member_form(_parts(batch=64), 64) == ('vmap', None)  # Another batch.
  assert member_forms.member_form(_parts(members=8), 32) == ('vmap', None)  # Another M.
  assert member_forms.member_form(_parts(parallelism='vmap'), 32) == ('vmap', None)  # Explicit.


def test_calibrating_a_real_step_times_every_candidate(cache):
  parts = _parts()
  best, seconds = calibration.calibrate(parts, 32, steps=1, rounds=1)
  assert list(seconds) == calibration.candidates(4) == [('vmap', None), ('map', None),
                                                       ('map', 2)]
  assert all(s > 0 for s in seconds.values()) and best == min(seconds, key=seconds.get)
  assert calibration.lookup(calibration.run_key(parts, 32)) == best


def test_plan_calibrate_prints_every_form_and_where_it_cached(cache):
  from dist_ens import plan as plan_lib
  config = dist_ens.load_config(DEFAULT)
  config.num_members, config.model.widths, config.data.batch_size = 4, (16,), 32
  config.mesh.member, config.mesh.data = 1, 1
  text = plan_lib.calibrate(config, jax.devices()[:1])
  assert f'cache: {cache}' in text and text.count('<- cached for member_parallelism=auto') == 1
  assert cache.exists() and 'map (chunks of 2)' in text


def test_plan_calibrate_times_and_caches_each_member_group(cache, monkeypatch):
  """With config.ensemble.groups, each group's own step is timed, and its fastest form is
  the one member_parallelism='auto' then gives that group (its model, members per device)."""
  from dist_ens import plan as plan_lib  # pylint: disable=g-import-not-at-top
  timings = iter([{('vmap', None): 1.0, ('map', None): 2.0, ('map', 2): 3.0},
                  {('vmap', None): 3.0, ('map', None): 2.0, ('map', 2): 1.0}])
  monkeypatch.setattr(calibration, 'time_forms', lambda *a, **k: next(timings))
  config = dist_ens.load_config(DEFAULT)
  config.num_members, config.data.batch_size = 8, 32
  config.mesh.member, config.mesh.data = 1, 1
  config.ensemble.groups = ({'count': 4, 'model': {'widths': (16,)}},
                            {'count': 4, 'model': {'widths': (8, 8)}, 'name': 'deep'})
  text = plan_lib.calibrate(config, jax.devices()[:1])
  assert "stack 'group0' (4 members)" in text and "stack 'deep' (4 members)" in text
  assert text.count('<- cached for member_parallelism=auto') == 2
  groups = assemble.build_run(config, devices=jax.devices()[:1],
                              shapes=plan_lib.data_shape(config)).parts.stacks
  assert [member_forms.member_form(g, 32) for g in groups] == [('vmap', None), ('map', 2)]
