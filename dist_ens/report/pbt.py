"""The report's population-based-training figure: every member's hyperparameters over
the run and the validation metric PBT ranked them by, with each copy marked.

Read from metrics.jsonl's {'split': 'pbt'} events (one per round: the metric values it
ranked, the sources and the hyperparameters after the round) and the run's starting
hyperparameters (config.json's sweep, resolved as training resolves it).
"""

from pathlib import Path
from typing import Any

import numpy as np

from dist_ens.core import hparams as hparams_lib
from dist_ens.report import plots as plots
from dist_ens.config.specs import resolve_hparams


def schedules(config: Any, events: list[dict[str, Any]]) -> dict[str, Any]:
  """{'steps': [R + 1] (0, then each round's step), 'fields': {field: [M, R + 1] values
  from the start and after each round}, 'metric': name, 'values': [M, R] the ranked metric,
  'copied': [M, R] bool, a member that copied another at that round}."""
  rounds = sorted((e for e in events if e.get('split') == 'pbt'), key=lambda e: e['step'])
  start = resolve_hparams(config)
  fields = list(rounds[0]['pbt']['hparams']) if rounds else []
  out = {'steps': np.array([0] + [e['step'] for e in rounds]),
         'fields': {}, 'metric': rounds[0]['pbt']['metric'] if rounds else '',
         'values': np.array([e['pbt']['values'] for e in rounds], float).T,
         'copied': np.array([[s != m for m, s in enumerate(e['pbt']['sources'])]
                             for e in rounds], bool).T}
  for field in fields:
    # As the rounds' events write them (shortest decimals of the float32 values): the raw
    # float32 start, 0.9 - 2.4e-8, drew a step to 0.9 for a field that never changed.
    series = [np.asarray(hparams_lib.as_written(start[field]), float)] + [
        np.asarray(e['pbt']['hparams'][field], float) for e in rounds]
    out['fields'][field] = np.stack(series, axis=1)
  return out


def plot_pbt(out: Path, config: Any, events: list[dict[str, Any]]) -> bool:
  """pbt: one panel per explored hyperparameter and one for the ranked metric; returns
  False (drawing nothing) when the run has no PBT round."""
  s = schedules(config, events)
  if not len(s['steps']) > 1:
    return False
  explored = [f for f, v in s['fields'].items() if np.ptp(v) > 0]
  fig, axes = plots._figure(4.2 * (len(explored) + 1), 3.6, len(explored) + 1)  # pylint: disable=protected-access
  colors = [f'C{m % 10}' for m in range(s['values'].shape[0])]
  for ax, field in zip(axes, explored):
    values = s['fields'][field]
    for m, row in enumerate(values):
      ax.step(s['steps'], row, where='post', color=colors[m], lw=1)
      hit = np.flatnonzero(s['copied'][m]) + 1
      ax.plot(s['steps'][hit], row[hit], 'o', color=colors[m], ms=4)
    if values.min() > 0 and values.max() / values.min() > 10:
      ax.set_yscale('log')
    ax.set(title=field, xlabel='step')
  ax = axes[-1]
  for m, row in enumerate(s['values']):
    ax.plot(s['steps'][1:], row, '-', color=colors[m], lw=1)
    hit = np.flatnonzero(s['copied'][m])
    ax.plot(s['steps'][1:][hit], row[hit], 'o', color=colors[m], ms=4)
  ax.set(title=f'validation {s["metric"]} (ranked)', xlabel='step')
  plots._save(fig, out, 'pbt')  # pylint: disable=protected-access
  return True
