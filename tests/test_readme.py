"""README.md's Python snippets run as written, and the README and docs/ hold together.

Every ```python block of README.md is run, in order, as ONE script (later blocks use names
earlier ones define, as a reader following along would) in a fresh interpreter with 8 fake CPU
devices, from the repository root (the snippets use relative paths such as
configs/default.py and examples.plain_jax). '/tmp/' workdirs are redirected into pytest's
tmp_path so reruns start fresh. A block preceded by the comment `<!-- not-run -->` is left
out: that is only for blocks that need hardware or downloads we do not have here (a GPU
cluster, a TPU pod, a TFDS dataset). Shell blocks are never run; the CLI has its own tests
(tests/test_cli.py, tests/test_train.py runs the install command's training).
"""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import support

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
NOT_RUN = '<!-- not-run -->'
_FENCE = re.compile(r'^```(\w*)\s*$')


def code_blocks(text: str) -> list[tuple[str, str, bool]]:
  """(language, code, marked not-run) for every fenced block, in order."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    match = _FENCE.match(lines[i])
    if not match:
      i += 1
      continue
    previous = next((l.strip() for l in reversed(lines[:i]) if l.strip()), '')
    start = i + 1
    i = start
    while i < len(lines) and lines[i].strip() != '```':
      i += 1
    blocks.append((match.group(1), '\n'.join(lines[start:i]), previous == NOT_RUN))
    i += 1
  return blocks


def test_readme_python_blocks_run(tmp_path):
  blocks = [code for lang, code, skip in code_blocks(README.read_text())
            if lang == 'python' and not skip]
  assert blocks, 'README.md has no python blocks'
  script = '\n\n'.join(blocks).replace("'/tmp/", f"'{tmp_path}/")
  (tmp_path / 'readme_snippets.py').write_text(script)
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=support.xla_flags(8))
  # Fed on stdin, so the repository root (the cwd) is on sys.path as in a session started
  # there, and `examples.plain_jax` imports.
  proc = subprocess.run([sys.executable, '-'], input=script, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (
      f'README.md snippets failed (script: {tmp_path / "readme_snippets.py"}):\n'
      f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}')


def test_readme_keeps_the_two_commands_and_stays_short():
  text = README.read_text()
  assert ('pip install -e . && dist-ens --config=configs/default.py '
          '--workdir=/tmp/dist_ens_run') in text
  assert "pip install -e '.[test]' && pytest -q" in text
  assert len(text.splitlines()) <= 320, 'README.md should stay a user guide; move detail to docs/'
  assert 'RESULTS_TABLE' not in text, 'paste the table of benchmarks/readme_results.py'


def test_links_in_readme_and_docs_resolve():
  broken = []
  for page in [README, *sorted((ROOT / 'docs').glob('*.md'))]:
    for target in re.findall(r'\]\(([^)\s]+)\)', page.read_text()):
      if re.match(r'[a-z]+://', target) or target.startswith('#'):
        continue
      path = (page.parent / target.split('#')[0]).resolve()
      if not path.exists():
        broken.append(f'{page.relative_to(ROOT)}: {target}')
  assert not broken, f'links to missing files: {broken}'


def test_mesh_picture_is_valid_svg():
  root = ET.parse(ROOT / 'docs' / 'mesh.svg').getroot()
  assert root.tag.endswith('svg')
  assert 'docs/mesh.svg' in README.read_text()


def test_the_accelerator_extras_the_readme_names_install_jaxs_own():
  # `pip install -e '.[cuda12]'` etc. cannot be tried here (no GPU, no such wheels needed):
  # check that every extra the README tells GPU/TPU users to install exists and pulls
  # jax's own extra of the same name, at least the supported jax.
  import tomllib  # pylint: disable=g-import-not-at-top
  extras = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project'][
      'optional-dependencies']
  named = set(re.findall(r"'\.\[(\w+)\]'", (ROOT / 'README.md').read_text()))
  accelerators = named & {'cuda12', 'cuda13', 'tpu'}
  assert accelerators == {'cuda12', 'cuda13', 'tpu'}, named
  for extra in accelerators:
    assert extras[extra] == [f'jax[{extra}]>=0.10.2'], (extra, extras.get(extra))
