"""TfdsSource's short PNG decode (dist_ens/data/tfds_source.py, _PngRecords) gives TFDS's
own arrays bit for bit: each plain PNG decodes to what TFDS's Image feature decodes, any
other PNG (or a JPEG) is left to TFDS, and a split mixing both reads as TFDS reads it."""

import io

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image, PngImagePlugin

from dist_ens import data
from dist_ens.data import tfds_source

SIZE = 12


def _png(array, mode=None, **save):
  buffer = io.BytesIO()
  image = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
  image.save(buffer, 'PNG', **save)
  return buffer.getvalue()


def _pixels(seed, channels, smooth=False):
  """Random pixels, or a smooth ramp (PIL then picks other row filters: Sub, Up, Paeth)."""
  rng = np.random.default_rng(seed)
  if smooth:
    ramp = np.add.outer(np.arange(SIZE), 2 * np.arange(SIZE))[..., None] + 7 * np.arange(channels)
    return (ramp + rng.integers(0, 3, ramp.shape)).astype(np.uint8)
  return rng.integers(0, 256, (SIZE, SIZE, channels), dtype=np.uint8)


def _text():
  info = PngImagePlugin.PngInfo()
  info.add_text('comment', 'a tEXt chunk')
  return info


def _plain_pngs():
  """(PNG bytes, the feature's channels) of PNGs as TFDS and PIL write image arrays."""
  pngs = []
  for seed, smooth in ((0, False), (1, True)):
    rgb, rgba, grey = _pixels(seed, 3, smooth), _pixels(seed, 4, smooth), _pixels(seed, 1, smooth)
    for level in (0, 1, 6, 9):
      pngs.append((_png(rgb, compress_level=level), 3))
    pngs += [(_png(rgb, optimize=True), 3), (_png(rgba), 4), (_png(grey[..., 0]), 1),
             (_png(grey[..., 0]), 3)]  # TFDS repeats a grey image over a feature's channels.
  return pngs


def _other_pngs():
  """(bytes, channels) that are not plain PNGs: TFDS's path decodes them."""
  rgb = _pixels(2, 3, smooth=True)
  plain = _png(rgb)
  jpeg = io.BytesIO()
  Image.fromarray(rgb).save(jpeg, 'JPEG')
  bad_crc = bytearray(plain)
  bad_crc[-5] ^= 1  # IEND's CRC.
  return [(_png(rgb, pnginfo=_text()), 3), (_png(rgb, dpi=(72, 72)), 3),
          (_png(rgb, transparency=(1, 2, 3)), 3), (_png(rgb, mode='P'), 1),
          (_png(rgb, mode='LA'), 2), (_png(rgb[..., 0].astype(np.uint16) * 200), 1),
          (jpeg.getvalue(), 3), (bytes(bad_crc), 3)]


def _tfds_decode(png, channels):
  return tfds.features.Image(shape=(None, None, channels)).decode_example_np(png)


@pytest.mark.parametrize('case', range(len(_plain_pngs())))
def test_a_plain_png_decodes_to_tfds_own_array(case):
  png, channels = _plain_pngs()[case]
  got, want = tfds_source._png_pixels(png, channels), _tfds_decode(png, channels)
  assert got is not None, 'a plain PNG went the long way'
  assert got.dtype == want.dtype == np.uint8 and got.shape == want.shape
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('case', range(len(_other_pngs())))
def test_any_other_image_is_left_to_tfds(case):
  png, channels = _other_pngs()[case]
  assert tfds_source._png_pixels(png, channels) is None


def test_a_truncated_png_is_left_to_tfds():
  png = _png(_pixels(3, 3))
  assert tfds_source._png_pixels(png[:len(png) // 2], 3) is None
  # Whole chunks, but the compressed data cut short: PIL raises, so does TFDS's path.
  plain = tfds_source._plain_png(png)
  assert plain is not None
  cut = io.BytesIO()
  cut.write(png[:33])  # signature + IHDR
  data_chunk = plain[3][:len(plain[3]) // 2]
  PngImagePlugin.putchunk(cut, b'IDAT', data_chunk)
  PngImagePlugin.putchunk(cut, b'IEND', b'')
  assert tfds_source._plain_png(cut.getvalue()) is not None
  assert tfds_source._png_pixels(cut.getvalue(), 3) is None


# A split mixing plain PNGs with others, and an extra text feature as CIFAR-10 has.
_RECORDS = ([png for png, channels in _plain_pngs() if channels == 3]
            + [png for png, channels in _other_pngs() if channels == 3])
_PLAIN = len([1 for _, channels in _plain_pngs() if channels == 3])


class MixedPngs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'id': tfds.features.Text(),
        'image': tfds.features.Image(shape=(SIZE, SIZE, 3)),
        'label': tfds.features.ClassLabel(num_classes=10)}), supervised_keys=('image', 'label'))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(), 'test': self._generate_examples()}

  def _generate_examples(self):
    for i, png in enumerate(_RECORDS):
      yield i, {'id': f'example_{i}', 'image': png, 'label': (7 * i) % 10}


@pytest.fixture(scope='module')
def train(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tfds_png'))
  MixedPngs(data_dir=path, file_format='array_record').download_and_prepare()
  return data.load_dataset('mixed_pngs', data.DataSpec('mixed_pngs', data_dir=path)).train


def test_a_split_reads_as_tfds_reads_it(train, monkeypatch):
  assert train._png is not None  # pylint: disable=protected-access
  features = train._source.dataset_info.features  # pylint: disable=protected-access
  long_way = []
  deserialize = features.deserialize_example_np
  monkeypatch.setattr(features, 'deserialize_example_np',
                      lambda record, **kw: long_way.append(1) or deserialize(record, **kw))
  n = train.num_examples
  indices = np.concatenate([np.random.default_rng(0).permutation(n), [3, 0, 3]])
  # Which examples are plain PNGs, by their id (TFDS stores them in its own order).
  plain = [int(train._source[i]['id'].split(b'_')[1]) < _PLAIN  # pylint: disable=protected-access
           for i in range(n)]
  long_way.clear()
  x, y = train.read(indices)
  assert len(long_way) == sum(not plain[i] for i in indices)
  long_way.clear()
  want_x, want_y = train.tfds_decoding().read(indices)
  assert len(long_way) == len(indices)  # TFDS's own path, for every record.
  assert x.dtype == want_x.dtype == np.float32 and y.dtype == want_y.dtype == np.int32
  np.testing.assert_array_equal(x.view(np.uint32), want_x.view(np.uint32))
  np.testing.assert_array_equal(y, want_y)


def test_tfds_decoding_with_opencv_keeps_its_own_path(train, monkeypatch):
  from tensorflow_datasets.core.features import image_feature  # pylint: disable=g-import-not-at-top
  source = train._source  # pylint: disable=protected-access
  assert tfds_source._PngRecords.for_source(source, 'image', 'label') is not None
  monkeypatch.setattr(image_feature, 'cv2', object())
  assert tfds_source._PngRecords.for_source(source, 'image', 'label') is None
