"""Summarises tools/compile_profile's JSON lines: CPU, compile, tracing and lowering
seconds, persistent-cache hits, and the programs that took the most compile time."""

import collections
import json
import sys

_PREFIX = '/jax/core/compile/'


def main(path: str = '/tmp/compile_profile.jsonl', top: int = 20) -> None:
  records = [json.loads(line) for line in open(path, encoding='utf-8')]
  seconds, counts = collections.Counter(), collections.Counter()
  for r in records:
    seconds.update(r['seconds'])
    counts.update(r['counts'])
  print(f"{len(records)} processes, {sum(r['cpu'] for r in records):.0f} CPU s")
  for name in ('backend_compile_duration', 'jaxpr_trace_duration',
               'jaxpr_to_mlir_module_duration'):
    print(f'{name:32s} {seconds[_PREFIX + name]:8.1f} s {counts[_PREFIX + name]:6d} times')
  print(f"persistent cache: {counts['/jax/compilation_cache/cache_hits']} hits, "
        f"{counts['/jax/compilation_cache/cache_misses']} misses")
  _cache_lookups(records)
  programs = sorted(((k, v) for k, v in seconds.items() if k.startswith('F:')),
                    key=lambda kv: -kv[1])
  for name, s in programs[:top]:
    print(f'{s:8.1f} s {counts[name]:5d}  {name[2:]}')


def _cache_lookups(records: list[dict]) -> None:
  """What reusing programs could save: lookups of a key the process itself compiled or
  read before (its tracing and lowering were done again), and keys compiled twice."""
  compiled_by = collections.defaultdict(int)
  again = elsewhere = misses = 0
  compile_cpu = collections.Counter()
  for r in records:
    seen = set()
    for program, key, hit, cpu in r.get('keys', []):
      if not hit:
        misses += 1
        compiled_by[key] += 1
        compile_cpu[program] += cpu
      elif key in seen:
        again += 1
      else:
        elsewhere += 1
      seen.add(key)
  twice = sum(1 for n in compiled_by.values() if n > 1)
  print(f'cache lookups: {misses} compiled, {again} read again by the process that had '
        f'compiled or read them, {elsewhere} read from another process; {twice} keys '
        'compiled by more than one process')
  for program, cpu in compile_cpu.most_common(8):
    print(f'{cpu:8.1f} CPU s compiling {program}')


if __name__ == '__main__':
  main(*sys.argv[1:2])
