"""Mesh resolution from config and its validation."""

from unittest import mock

import jax
import numpy as np
import pytest

from dist_ens.run import mesh_layout
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.errors import ConfigError


def _cfg(member, data, hosts_along='member'):
  return mesh_lib.MeshSpec(member=member, data=data, hosts_along=hosts_along)


@pytest.mark.parametrize('member,data,expected', [
    (-1, 1, (8, 1)), (-1, 2, (4, 2)), (2, -1, (2, 4)), (1, -1, (1, 8)), (4, 2, (4, 2))])
def test_fill_resolves_to_device_count(member, data, expected):
  mesh = mesh_lib.make_mesh(_cfg(member, data))
  assert (mesh.shape['member'], mesh.shape['data']) == expected
  assert mesh.axis_names == ('member', 'data')


@pytest.mark.parametrize('member,data,message', [
    (3, 2, r'config.mesh.member x config.mesh.data = 3 x 2 = 6 but 8 devices.*\(2, 4\)'),
    (-1, 3, r'config.mesh.data=3 does not divide the 8 devices; use one of \[1, 2, 4, 8\]'),
    (-1, -1, 'both -1'),
    (0, 1, r'config.mesh.member=0 must be a positive int or -1'),
])
def test_bad_mesh_names_field_and_valid_values(member, data, message):
  with pytest.raises(ConfigError, match=message):
    mesh_lib.make_mesh(_cfg(member, data))


def test_divisibility_errors_name_field_and_alternatives():
  mesh = mesh_lib.make_mesh(_cfg(4, 2))
  with pytest.raises(ConfigError, match=r'config.num_members=6 is not divisible by mesh.member=4'):
    mesh_lib.check_divisibility(mesh, num_members=6, batch_size=128)
  with pytest.raises(ConfigError, match=r'config.data.batch_size=127 is not divisible by mesh.data=2'):
    mesh_lib.check_divisibility(mesh, num_members=8, batch_size=127)
  mesh_lib.check_divisibility(mesh, num_members=8, batch_size=128)


def test_unknown_hosts_along_is_rejected():
  with pytest.raises(ConfigError, match='hosts_along'):
    mesh_lib.make_mesh(_cfg(4, 2, hosts_along='rows'))


def test_hosts_along_chooses_the_slow_axis():
  # Devices are ordered by (process, id); the axis named by hosts_along must be the
  # one whose index changes slowest, so it runs across processes.
  ids = lambda mesh: np.vectorize(lambda d: d.id)(mesh.devices)
  by_member = ids(mesh_lib.make_mesh(_cfg(2, 4, 'member')))
  np.testing.assert_array_equal(by_member, np.arange(8).reshape(2, 4))
  by_data = ids(mesh_lib.make_mesh(_cfg(2, 4, 'data')))
  np.testing.assert_array_equal(by_data, np.arange(8).reshape(4, 2).T)


def test_explicit_device_subset():
  mesh = mesh_lib.make_mesh(_cfg(-1, 1), devices=jax.devices()[:1])
  assert mesh.size == 1


@pytest.mark.parametrize('num_devices,expected', [(3, (2, 1)), (6, (4, 1)), (8, (8, 1))])
def test_fill_fits_members_to_the_devices(num_devices, expected):
  # The default mesh (member=-1, data=1) with 8 members: the most devices such
  # that mesh.member divides 8; the rest stay idle.
  devices = jax.devices()[:num_devices]
  mesh = mesh_lib.make_mesh(_cfg(-1, 1), devices, num_members=8, batch_size=128)
  assert (mesh.shape['member'], mesh.shape['data']) == expected
  assert set(mesh.devices.flat) <= set(devices)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in devices[:mesh.size]]


@pytest.mark.parametrize('num_devices,num_members,expected', [
    (6, 6, (6, 1)), (8, 6, (2, 4)), (3, 8, (2, 1)), (6, 8, (4, 1)), (8, 8, (8, 1))])
def test_both_fill_uses_most_devices_preferring_member(num_devices, num_members, expected):
  mesh = mesh_lib.make_mesh(_cfg(-1, -1), jax.devices()[:num_devices],
                            num_members=num_members, batch_size=128)
  assert (mesh.shape['member'], mesh.shape['data']) == expected


def test_fill_keeps_the_fixed_axis():
  mesh = mesh_lib.make_mesh(_cfg(-1, 2), jax.devices()[:6], num_members=8, batch_size=128)
  assert (mesh.shape['member'], mesh.shape['data']) == (2, 2)
  mesh = mesh_lib.make_mesh(_cfg(2, -1), jax.devices()[:6], num_members=8, batch_size=96)
  assert (mesh.shape['member'], mesh.shape['data']) == (2, 3)


def test_fill_describes_the_chosen_mesh():
  # A debug line here; the trainer logs the mesh at INFO once every check has passed.
  with mock.patch.object(mesh_lib.logging, 'debug') as debug:
    mesh_lib.make_mesh(_cfg(-1, 1), jax.devices()[:3], num_members=8, batch_size=128)
  assert debug.call_count == 1
  line = debug.call_args[0][0] % debug.call_args[0][1:]
  assert 'member=2 x data=1' in line and '2 of 3 devices' in line


def test_fill_without_any_mesh_names_what_would_work():
  with pytest.raises(ConfigError, match=r'config.mesh.data=3.*batch_size=128.*\[1, 2, 4, 8\]'):
    mesh_lib.make_mesh(_cfg(-1, 3), num_members=8, batch_size=128)
  with pytest.raises(ConfigError, match=r'config.mesh.member=3.*num_members=8.*\[1, 2\]'):
    mesh_lib.make_mesh(_cfg(3, -1), jax.devices()[:3], num_members=8, batch_size=128)


def test_explicit_shapes_are_not_fitted():
  # No -1: exactly as given, with the same errors as without num_members.
  with pytest.raises(ConfigError, match=r'3 x 2 = 6 but 8 devices'):
    mesh_lib.make_mesh(_cfg(3, 2), num_members=6, batch_size=128)
  mesh = mesh_lib.make_mesh(_cfg(4, 2), num_members=6, batch_size=128)
  assert (mesh.shape['member'], mesh.shape['data']) == (4, 2)


def test_idle_devices_get_one_warning_saying_what_to_set(caplog):
  import dist_ens
  from pathlib import Path
  config = dist_ens.load_config(Path(__file__).parent.parent / 'configs' / 'default.py')
  with caplog.at_level('WARNING'):
    mesh = mesh_layout.build_mesh(config, jax.devices()[:6])  # 8 members on 6 devices
  assert mesh.size == 4
  warned = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
  assert any('2 of 6 devices stay idle' in w and 'num_members=12' in w for w in warned), warned
  with caplog.at_level('WARNING'):
    caplog.clear()
    mesh_layout.build_mesh(config, jax.devices()[:4])
  assert not [r for r in caplog.records if r.levelname == 'WARNING']
