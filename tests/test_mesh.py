"""Mesh resolution from config and its validation."""

import jax
import ml_collections
import numpy as np
import pytest

from dist_ens.parallel import mesh as mesh_lib
from dist_ens.errors import ConfigError


def _cfg(member, data, hosts_along='member'):
  return ml_collections.ConfigDict(dict(member=member, data=data, hosts_along=hosts_along))


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
