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
  programs = sorted(((k, v) for k, v in seconds.items() if k.startswith('F:')),
                    key=lambda kv: -kv[1])
  for name, s in programs[:top]:
    print(f'{s:8.1f} s {counts[name]:5d}  {name[2:]}')


if __name__ == '__main__':
  main(*sys.argv[1:2])
