"""The UCI regression reader, splits and standardisation (dist_ens/data/uci.py)."""

import numpy as np
import pytest

from dist_ens.data import uci
from dist_ens.errors import ConfigError


def _write(tmp_path, text, name='data.txt'):
  path = tmp_path / name
  path.write_text(text)
  return path


def test_reader_parses_mixed_whitespace_and_keeps_float_targets(tmp_path):
  path = _write(tmp_path, '1 2\t0.25\n\n# a comment\n  3.5e0   -4 1e-3  \n')
  x, y = uci.read_uci(path)
  assert x.dtype == np.float32 and y.dtype == np.float32
  np.testing.assert_array_equal(x, [[1, 2], [3.5, -4]])
  # Targets below 1 survive: nothing casts them to integer classes.
  np.testing.assert_array_equal(y, np.float32([0.25, 1e-3]))


@pytest.mark.parametrize('text, line, words', [
    ('1 2 3\n4 5\n', 2, '2 columns where the rows above have 3'),
    ('1 2 3\n4 five 6\n', 2, "feature 1 is 'five', not a number"),
    ('1 2 3\n4 5 nan\n', 2, "the target is 'nan'; values must be finite"),
    ('1 2 3\n\n4 5 -inf\n', 3, "the target is '-inf'"),
    ('1 inf 3\n', 1, "feature 1 is 'inf'"),
    ('7\n', 1, 'at least one feature and the target'),
])
def test_reader_errors_name_file_and_line_in_one_line(tmp_path, text, line, words):
  path = _write(tmp_path, text)
  with pytest.raises(ConfigError) as e:
    uci.read_uci(path)
  message = str(e.value)
  assert f'{path}, line {line}:' in message and words in message, message
  assert '\n' not in message


def test_reader_refuses_missing_and_empty_files(tmp_path):
  with pytest.raises(ConfigError, match='cannot be read'):
    uci.read_uci(tmp_path / 'absent.txt')
  with pytest.raises(ConfigError, match='holds no rows'):
    uci.read_uci(_write(tmp_path, '\n# only a comment\n'))


# Rows and features of the shipped sets, from /work/shared/data/uci/README.md's table.
@pytest.mark.parametrize('name, rows, features', [
    ('concrete', 1030, 8), ('energy', 768, 8), ('yacht', 308, 6), ('wine-quality-red', 1599, 11),
])
def test_shipped_sets_load_with_their_published_sizes(name, rows, features):
  x, y = uci.read_uci(uci.resolve_uci_name(f'uci:{name}'))
  assert x.shape == (rows, features) and y.shape == (rows,)
  assert np.isfinite(x).all() and np.isfinite(y).all()
  assert (uci.SHIPPED[name].parent / 'README.md').is_file()  # the attribution travels along


def test_names_resolve_to_shipped_files_or_paths(tmp_path):
  assert uci.resolve_uci_name('uci:energy') == uci.SHIPPED['energy']
  path = _write(tmp_path, '1 2\n')
  assert uci.resolve_uci_name(f'uci:{path}') == path
  with pytest.raises(ConfigError) as e:
    uci.resolve_uci_name('uci:kin8nm')
  assert "'uci:energy'" in str(e.value) and "'uci:yacht'" in str(e.value)
  with pytest.raises(ConfigError, match="not a UCI data name"):
    uci.resolve_uci_name('energy')


def test_split_is_deterministic_disjoint_and_covers_all_examples():
  train, test = uci.uci_split(308, split_index=3)
  again_train, again_test = uci.uci_split(308, split_index=3)
  np.testing.assert_array_equal(train, again_train)
  np.testing.assert_array_equal(test, again_test)
  assert len(test) == 31 and len(train) == 277  # round(0.1 * 308)
  assert not set(train) & set(test)
  np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(308))
  # Other split indices and seeds give other splits.
  assert not np.array_equal(test, uci.uci_split(308, split_index=4)[1])
  assert not np.array_equal(test, uci.uci_split(308, split_index=3, seed=1)[1])


def test_split_refuses_fractions_that_leave_a_side_empty():
  for fraction in (0.0, 1.0, 0.99):
    with pytest.raises(ConfigError, match='test_fraction'):
      uci.uci_split(10, 0, test_fraction=fraction)
  with pytest.raises(ConfigError, match='>= 0'):
    uci.uci_split(10, -1)


def test_load_uci_returns_the_split_in_original_units():
  x, y = uci.read_uci(uci.SHIPPED['concrete'])
  train_idx, test_idx = uci.uci_split(len(y), split_index=2, seed=5)
  train, test = uci.load_uci('uci:concrete', split_index=2, seed=5)
  np.testing.assert_array_equal(train.x, x[train_idx])
  np.testing.assert_array_equal(test.y, y[test_idx])
  assert train.num_examples + test.num_examples == 1030


def test_standardizer_uses_training_statistics_and_inverts_to_target_units():
  rng = np.random.default_rng(0)
  x = rng.normal(50.0, 7.0, (200, 3)).astype(np.float32)
  x[:, 2] = 4.0  # constant column
  y = rng.normal(-30.0, 0.5, 200).astype(np.float32)
  scale = uci.Standardizer.fit(x, y)
  xs, ys = scale.apply(x, y)
  assert xs.dtype == np.float32 and ys.dtype == np.float32
  np.testing.assert_allclose(xs[:, :2].mean(0), 0.0, atol=1e-5)
  np.testing.assert_allclose(xs[:, :2].std(0), 1.0, atol=1e-5)
  np.testing.assert_allclose(ys.std(), 1.0, atol=1e-5)
  # The constant column is centred, not scaled: a different test value stays moderate.
  assert scale.x_std[2] == 1.0 and scale.apply_inputs(np.float32([[50, 50, 5.0]]))[0, 2] == 1.0
  # Round trip, as Ensemble.predict maps back: a standardised target in original units.
  np.testing.assert_allclose(ys * scale.y_std + scale.y_mean, y, rtol=1e-6, atol=1e-5)
  # A variance of 1 in standardised units is the target's own variance (0.5^2 here).
  np.testing.assert_allclose(scale.y_std ** 2, np.var(y.astype(np.float64)), rtol=1e-5)
