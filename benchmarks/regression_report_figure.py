"""docs/report_regression_calibration.png: the report's calibration figure of configs/uci.py.

  python -m benchmarks.regression_report_figure [--workdir /tmp/uci_report]

Trains configs/uci.py (5 members on the shipped energy set, about 15 s on 2 CPU cores),
runs `dist-ens report` on it, and writes the report's calibration.png into docs/, shrunk and
palettised so the repository stays light; prints the curve's numbers.
"""

import argparse
import json
import shutil
from pathlib import Path

from PIL import Image

import dist_ens
from dist_ens.report import build as report, regression as report_regression

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'docs' / 'report_regression_calibration.png'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', default='/tmp/uci_report')
  workdir = Path(parser.parse_args().workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  final = dist_ens.train(dist_ens.load_config(ROOT / 'configs' / 'uci.py'), str(workdir))
  out = report.make_report(workdir)
  image = Image.open(out / 'calibration.png').convert('RGB')
  image = image.resize((image.width // 2, image.height // 2), Image.LANCZOS)
  image.quantize(colors=64).save(OUT, optimize=True)
  cal = json.loads((out / report_regression.CURVES_FILE).read_text())['calibration']
  print(f'ensemble RMSE {final["ensemble"]["rmse"]:.3f} NLL {final["ensemble"]["nll"]:.3f}')
  for level, ens, member in zip(cal['levels'], cal['ensemble'], cal['member_mean']):
    print(f'level {level:.2f}: ensemble covers {ens:.3f}, member mean {member:.3f}')
  print(f'wrote {OUT}')


if __name__ == '__main__':
  main()
