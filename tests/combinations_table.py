"""Which options combine (DESIGN.md property 8): the one table that tests/test_combinations.py
runs and tools/gen_combinations_doc.py writes into docs/combinations.md.

An option is a small named set of config overrides on one axis. Every pair of options from
different axes is VALID (it trains, resumes, loads and predicts), REFUSED (ConfigError in
one line naming both fields, before anything is written) or a KNOWN_FAILURE (a bug,
tested with xfail(strict=True) so that a fix shows up). Nothing here imports dist_ens:
the doc tool reads this file alone.
"""

from collections.abc import Iterator
from typing import Any, NamedTuple


class Option(NamedTuple):
  key: str  # unique over all axes; what REFUSED and KNOWN_FAILURES name
  overrides: dict[str, Any]  # dotted config fields -> values (config.update_from_flattened_dict)
  fields: tuple[str, ...]  # a refusal names at least one of these
  label: str = ''  # the docs' name; '' = key
  dataset: str = ''  # task options: which toy dataset the test builds
  # The key of the one option of another axis this one goes with (own=epinet names an
  # epinet's leaves: method=epinet). Its pairs with that axis's other options are
  # 'excluded', and with_defaults puts it in place of that axis's default.
  requires: str = ''

  @property
  def title(self) -> str:
    return self.label or self.key


_VALIDATION = {'data.validation_size': 32}

# Axis -> options, the default (what every other case uses) first. A feature axis is
# off (no override) or on.
AXES: dict[str, tuple[Option, ...]] = {
    'task': (
        Option('classification', {}, ('task',), dataset='classes'),
        Option('regression', {'task': 'regression'}, ('task',), dataset='targets'),
        Option('regression [N, D]', {'task': 'regression'}, ('task',), dataset='vectors'),
        # D means on the MSE; one noise level per member, fitted after training.
        Option('regression_homoscedastic', {'task': 'regression_homoscedastic'}, ('task',),
               dataset='targets', label='homoscedastic regression'),
        # Next-token prediction with the built-in causal transformer (a class per position).
        Option('token_classification', {
            'task': 'token_classification', 'model.name': 'token_transformer',
            'model.causal': True, 'model.pool': 'tokens', 'model.vocab_size': 6,
            'model.hidden': 8, 'model.depth': 1, 'model.heads': 2, 'model.mlp_dim': 16},
               ('task',), dataset='tokens'),
    ),
    'method': (
        Option('deep', {}, ('ensemble.method',)),
        Option('batchensemble', {'ensemble.method': 'batchensemble'}, ('ensemble.method',)),
        Option('mimo', {'ensemble.method': 'mimo', 'ensemble.mimo.heads': 2},
               ('ensemble.method',)),
        Option('snapshot', {'ensemble.method': 'snapshot', 'ensemble.snapshot.cycles': 2,
                            'optim.schedule': 'cosine'}, ('ensemble.method',)),
        Option('fge', {'ensemble.method': 'snapshot', 'ensemble.snapshot.cycles': 1,
                       'optim.schedule': 'cosine',
                       'ensemble.snapshot.start': 0.5, 'ensemble.snapshot.cycle_rate': 0.5},
               ('ensemble.method', 'ensemble.snapshot'), label='FGE (snapshot.start)'),
        Option('multiswag', {'ensemble.method': 'multiswag', 'ensemble.swag.start': 0.5,
                             'ensemble.swag.every': 1, 'ensemble.swag.rank': 1,
                             'ensemble.swag.samples': 2}, ('ensemble.method',)),
        # The prior of the member's architecture (any model kind; tests/test_prior.py
        # covers a smaller one, prior.widths).
        Option('prior', {'ensemble.method': 'prior'},
               ('ensemble.method',), label='randomized prior'),
        # A tiny epinet (tests/test_epinet.py checks its predictions and resume).
        Option('epinet', {'ensemble.method': 'epinet', 'ensemble.epinet.index_dim': 2,
                          'ensemble.epinet.widths': (4,), 'ensemble.epinet.samples': 2,
                          'ensemble.epinet.eval_samples': 3}, ('ensemble.method',)),
        # Fixed masks per member on one shared MLP (tests/test_masksembles.py; the CNN and
        # the ResNets there too).
        Option('masksembles', {'ensemble.method': 'masksembles'}, ('ensemble.method',)),
        # Members of width int(2 * 8) / 4 = 4, the hidden-to-hidden layer in 2 groups
        # (tests/test_packed.py).
        Option('packed', {'ensemble.method': 'packed', 'ensemble.packed.gamma': 2,
                          'model.widths': (8, 8)}, ('ensemble.method',),
               label='packed (Packed-Ensembles)'),
        # One cycle of the 2 steps: explore, then sample once (tests/test_sgmcmc.py checks
        # the sampler's posterior, resume and the collected members).
        Option('sgmcmc', {'ensemble.method': 'sgmcmc', 'ensemble.sgmcmc.sampler': 'sgld',
                          'ensemble.sgmcmc.cycles': 1, 'ensemble.sgmcmc.beta': 0.5,
                          'ensemble.sgmcmc.samples_per_cycle': 1,
                          'ensemble.sgmcmc.data_size': 1000}, ('ensemble.method',),
               label='sgmcmc (cyclical SG-MCMC)'),
        # Each member an SNGP: 16 random features, the precision over the last step
        # (tests/test_sngp.py checks its math, resume and the adjusted predictions).
        Option('sngp', {'ensemble.method': 'sngp', 'ensemble.sngp.features': 16,
                        'ensemble.sngp.cov_steps': 1, 'ensemble.sngp.data_size': 64},
               ('ensemble.method',), label='sngp (SNGP)'),
        # Rank-1 BNNs: one shared W, each member a Gaussian posterior over rank-1 factors,
        # 2 draws per example in training, 2 fixed draws at evaluation (tests/test_rank1.py
        # checks the KLs, the factorised forward, resume and the mixture's predictions).
        Option('rank1', {'ensemble.method': 'rank1', 'ensemble.rank1.data_size': 128,
                         'ensemble.rank1.train_samples': 2, 'ensemble.rank1.eval_samples': 2},
               ('ensemble.method',), label='rank1 (rank-1 BNN)'),
        Option('mc_dropout', {'model.dropout': 0.1, 'eval.mc_samples': 2},
               ('eval.mc_samples', 'model.dropout'), label='MC dropout'),
    ),
    'own': (
        Option('own=all', {}, ('ensemble.own',)),
        Option('own=head', {'ensemble.own': 'head'}, ('ensemble.own',)),
        Option('own=lora', {'ensemble.own': 'lora', 'ensemble.lora_rank': 2},
               ('ensemble.own',)),
        # Every member's epinet over one shared base network (tests/test_epinet_frozen_base.py
        # covers the base from model.init_from, frozen).
        # Its pairs are refused by either field (it implies method=epinet).
        Option('own=epinet', {'ensemble.own': 'epinet'}, ('ensemble.own', 'ensemble.method'),
               label='own=epinet (epinets on one base)', requires='epinet'),
    ),
    'layout': (
        Option('model=1', {}, ('mesh.model',)),
        # fsdp_min_size small enough that the tiny MLP's kernels are really split.
        Option('model=2', {'mesh.model': 2, 'mesh.fsdp_min_size': 16}, ('mesh.model',)),
    ),
}
_FEATURES = (
    Option('member_split', {'data.member_split': 'kfold:2'}, ('data.member_split',)),
    Option('pbt', {'pbt.enabled': True, 'pbt.interval': 1, **_VALIDATION,
                   'optim.learning_rate': 'loguniform(1e-4,1e-2)'}, ('pbt',)),
    Option('top_k', {'select.top_k': 2, **_VALIDATION}, ('select.top_k',),
           label='select top_k'),
    Option('greedy', {'select.method': 'greedy', 'select.greedy_size': 3, **_VALIDATION},
           ('select.method',), label='select greedy'),
    Option('temperature', {'eval.temperature_scaling': True, **_VALIDATION},
           ('eval.temperature_scaling',), label='temperature scaling'),
    Option('shift', {'eval.shift': 'gaussian_noise:1'}, ('eval.shift',)),
    # Conformal sets are calibrated whenever there is a validation split.
    Option('conformal', {'eval.conformal_alpha': 0.2, **_VALIDATION},
           ('eval.conformal_alpha', 'data.validation_size')),
    Option('laplace', {'eval.laplace': 'last_layer_kron', **_VALIDATION}, ('eval.laplace',),
           label='last-layer Laplace'),
    Option('reproducible', {'reproducible': True}, ('reproducible',)),
    Option('bf16', {'precision': 'bfloat16'}, ('precision',)),
    # Two member groups of different widths (tests/test_groups.py checks their members
    # against runs without groups).
    Option('groups', {'ensemble.groups': ({'count': 2, 'model': {'widths': (8,)}},
                                          {'count': 2, 'model': {'widths': (4, 4)}})},
           ('ensemble.groups',), label='member groups'),
    # A student distilled from the members after training (tests/test_distill.py checks
    # what it keeps of the ensemble's gain).
    Option('distill', {'distill.student': 'same', 'distill.steps': 2}, ('distill.student',),
           label='distillation'),
)
# The student as the user's own network (an import path): the one form member groups
# take, whose members have no one architecture to copy.
_STUDENTS = (Option('distill=path', {'distill.student': 'support:linear_student',
                                     'distill.steps': 2}, ('distill.student',),
                    label='distillation into your own network'),)
# Greedy selection of distinct members (each picked at most once).
_DISTINCT = (Option('greedy distinct', {'select.method': 'greedy', 'select.greedy_size': 3,
                                        'select.greedy_replacement': False, **_VALIDATION},
                    ('select.method', 'select.greedy_replacement'),
                    label='select greedy without replacement'),)
for _option in _FEATURES:
  AXES[_option.key] = (Option(f'no {_option.key}', {}, ()), _option)
AXES['distill'] += _STUDENTS
AXES['greedy'] += _DISTINCT

# One case each for the values of a closed set that no option above sets (a Laplace form,
# a member order, ...): every value of every such field runs in at least one case, with
# the other axes at their defaults (test_combinations checks that none is missing).
# `requires`: the option of an axis the value goes with (a regression loss: regression).
VALUES: tuple[Option, ...] = (
    Option('laplace diag', {'eval.laplace': 'last_layer_diag', **_VALIDATION},
           ('eval.laplace',)),
    Option('laplace full', {'eval.laplace': 'last_layer_full', **_VALIDATION},
           ('eval.laplace',)),
    Option('own=batchensemble', {'ensemble.own': 'batchensemble'}, ('ensemble.own',)),
    Option('order shuffled', {'data.member_order': 'shuffled'}, ('data.member_order',)),
    Option('order bootstrap', {'data.member_order': 'bootstrap'}, ('data.member_order',)),
    # 'auto' (the default: every case above) puts these small splits on the devices.
    Option('host pipeline', {'data.resident': False}, ('data.resident',)),
    Option('resident', {'data.resident': True}, ('data.resident',)),
    Option('holdout', {'data.member_split': 'holdout:2'}, ('data.member_split',)),
    Option('blocks', {'data.member_split': 'blocks:2'}, ('data.member_split',)),
    Option('hydra student', {'distill.student': 'hydra', 'distill.steps': 2},
           ('distill.student',)),
    Option('sgd', {'optim.name': 'sgd'}, ('optim.name',)),
    Option('linear schedule', {'optim.schedule': 'linear'}, ('optim.schedule',)),
    Option('step schedule', {'optim.schedule': 'step'}, ('optim.schedule',)),
    Option('cross_entropy', {'train.loss': 'cross_entropy'}, ('train.loss',)),
    Option('mse', {'train.loss': 'mse'}, ('train.loss',),
           requires='regression_homoscedastic'),
    Option('gaussian_nll', {'train.loss': 'gaussian_nll'}, ('train.loss',),
           requires='regression'),
)

OPTIONS: dict[str, Option] = {o.key: o for options in AXES.values() for o in options}
AXIS_OF: dict[str, str] = {o.key: axis for axis, options in AXES.items() for o in options}
DEFAULTS: tuple[Option, ...] = tuple(options[0] for options in AXES.values())


def _pair(a: str, b: str) -> frozenset[str]:
  return frozenset((a, b))


_NOT_DEEP = ('batchensemble', 'mimo', 'snapshot', 'fge', 'multiswag', 'masksembles',
             'sgmcmc')
_REGRESSION = ('regression', 'regression [N, D]', 'regression_homoscedastic')

# Pairs refused before anything runs, each with why (the docs show the reason).
REFUSED: dict[frozenset[str], str] = {
    **{_pair('pbt', m): 'PBT copies whole members; it needs ensemble.method=\'deep\''
       for m in _NOT_DEEP},
    **{_pair('pbt', o): "PBT copies whole members; shared leaves are no member's to copy"
       for o in ('own=head', 'own=lora')},
    _pair('pbt', 'member_split'): "PBT would copy members between splits that train on "
                                  'different data',
    **{_pair(o, m): 'a shared backbone works with independent (deep) members only'
       for o in ('own=head', 'own=lora') for m in _NOT_DEEP},
    **{_pair(o, 'prior'): "a shared backbone works with method='deep' or 'epinet' (a prior "
                          'beside a shared, frozen backbone is not built)'
       for o in ('own=head', 'own=lora')},
    _pair('token_classification', 'epinet'): "the epinet's index term is a [batch, units] "
                                              "output's, not per-position ones",
    **{_pair('temperature', t): 'temperature scaling is a classifier\'s (Task.calibrate)'
       for t in _REGRESSION},
    **{_pair('laplace', t): "the last-layer Laplace is the softmax cross-entropy's"
       for t in _REGRESSION},
    **{_pair('laplace', m): "Laplace fits each independently trained member's output layer"
       for m in (*_NOT_DEEP, 'own=head', 'own=lora')},
    _pair('laplace', 'epinet'): "an epinet's output is not linear in the base network's "
                                'output layer alone',
    _pair('token_classification', 'mimo'): "MIMO's heads split [batch, units] outputs, not "
                                           'per-position ones',
    _pair('token_classification', 'shift'): 'the corruptions perturb continuous inputs, not '
                                            'token ids',
    _pair('token_classification', 'laplace'): "the last-layer Laplace is a classifier's of one "
                                              'output vector per example',
    _pair('reproducible', 'batchensemble'): "the shared weights' gradient is a sum over "
                                            'devices in a mesh-dependent order',
    _pair('reproducible', 'mimo'): "the heads' shuffles of a batch split over data depend "
                                   'on the mesh',
    _pair('reproducible', 'masksembles'): "the shared weights' gradient is a sum over "
                                          'devices in a mesh-dependent order',
    _pair('token_classification', 'masksembles'): "its masks are the MLP's, the CNN's and "
                                                  "the ResNets' hidden layers, not a "
                                                  "transformer's",
    _pair('token_classification', 'packed'): "it packs the MLP's, the CNN's and the ResNets' "
                                             "layers, not a transformer's",
    **{_pair(o, 'packed'): "a shared backbone works with method='deep' or 'epinet' (packed "
                           "members' grouped layers are each member's own)"
       for o in ('own=head', 'own=lora')},
    **{_pair('groups', o): "a group's members predict one-to-one from their own outputs: "
                           'a method that collects, cycles or adds outputs is not built for '
                           'groups (docs/groups.md)'
       for o in ('mimo', 'snapshot', 'fge', 'multiswag', 'epinet', 'sgmcmc')},
    _pair('groups', 'distill'): "a student of the members' architecture: the groups have "
                                'several (give the student as an import path)',
    **{_pair(d, t): "the student learns a classifier's soft targets over classes"
       for d in ('distill', 'distill=path')
       for t in (*_REGRESSION, 'token_classification')},
    # One noise level per trained member (Task.any_members): no other members to score.
    **{_pair('regression_homoscedastic', o): 'its noise is one fitted level per trained '
                                            'member: members chosen, sampled or collected '
                                            'have none (Task.any_members)'
       for o in ('greedy', 'greedy distinct', 'mc_dropout', 'snapshot', 'fge', 'multiswag',
                 'sgmcmc', 'groups')},
    **{_pair(d, m): "the student learns from independently trained members of the "
                    "run's model, not shared leaves or other predicting weights"
       for d in ('distill', 'distill=path')
       for m in (*_NOT_DEEP, 'prior', 'epinet', 'packed', 'own=head', 'own=lora')},
}
# SNGP: a softmax classifier of its members' own normalised MLP, CNN or ResNet and GP layer.
REFUSED.update({
    **{_pair(t, 'sngp'): "its GP layer's logits and their mean-field adjustment are a softmax "
                         "classifier's of one output vector per example"
       for t in (*_REGRESSION, 'token_classification')},
    **{_pair(o, 'sngp'): "a shared backbone works with method='deep' or 'epinet' (an SNGP "
                         "member's normalised layers and GP layer are its own)"
       for o in ('own=head', 'own=lora')},
    _pair('laplace', 'sngp'): 'its GP output layer has a Laplace posterior of its own',
    **{_pair(d, 'sngp'): "the student learns from independently trained members of the "
                         "run's model, not shared leaves or other predicting weights"
       for d in ('distill', 'distill=path')},
})
# Rank-1 BNNs: one shared W per kernel (BatchEnsemble's entries), each member a mixture
# component's posterior over its factors, predicting the mean over its factor draws.
REFUSED.update({
    _pair('pbt', 'rank1'): "PBT copies whole members; it needs ensemble.method='deep'",
    **{_pair(o, 'rank1'): 'a shared backbone works with independent (deep) members only'
       for o in ('own=head', 'own=lora')},
    _pair('laplace', 'rank1'): "Laplace fits each independently trained member's output layer",
    _pair('reproducible', 'rank1'): "the shared weights' gradient is a sum over devices in a "
                                    'mesh-dependent order',
    _pair('token_classification', 'rank1'): "its factors are on the kernels of the MLP, "
                                             "the CNN, LeNet-5 and the ResNets, not a "
                                             "transformer's",
    _pair('regression_homoscedastic', 'rank1'): 'its noise is one fitted level per trained '
                                                "member: a member's mean over its factor draws "
                                                'has none (Task.any_members)',
    _pair('groups', 'rank1'): "a group's members predict one-to-one from their own outputs: "
                              'a method that adds outputs (its factor draws) is not built for '
                              'groups (docs/groups.md)',
    **{_pair(d, 'rank1'): "the student learns from independently trained members of the "
                          "run's model, not shared leaves or other predicting weights"
       for d in ('distill', 'distill=path')},
})
# own=epinet is an epinet's option: what an epinet is refused with, it is too; and its base
# is shared, which PBT cannot copy.
REFUSED.update({frozenset({'own=epinet', *(pair - {'epinet'})}): why
                for pair, why in list(REFUSED.items()) if 'epinet' in pair})
REFUSED[frozenset({'own=epinet', 'pbt'})] = ("PBT copies whole members; a shared base is no "
                                             "member's to copy")

# Pairs that should work and do not yet: the test expects them to fail (xfail strict).
KNOWN_FAILURES: dict[frozenset[str], str] = {}


def outcome(a: str, b: str) -> str:
  """'same axis', 'excluded' (one requires another option of the other's axis),
  'refused', 'known failure' or 'valid' for two option keys."""
  if AXIS_OF[a] == AXIS_OF[b]:
    return 'same axis'
  for x, y in ((a, b), (b, a)):
    need = OPTIONS[x].requires
    if need and AXIS_OF[need] == AXIS_OF[y] and y != need:
      return 'excluded'
  pair = _pair(a, b)
  if pair in REFUSED:
    return 'refused'
  return 'known failure' if pair in KNOWN_FAILURES else 'valid'


def all_pairs() -> Iterator[tuple[Option, Option]]:
  """Every pair of options from different axes, defaults and 'off' included."""
  axes = list(AXES.values())
  for i, first in enumerate(axes):
    for second in axes[i + 1:]:
      for a in first:
        for b in second:
          yield a, b


def _merge(options: tuple[Option, ...]) -> dict[str, Any] | None:
  """The options' overrides together, or None where two set one field differently."""
  merged: dict[str, Any] = {}
  for option in options:
    for field, value in option.overrides.items():
      if merged.setdefault(field, value) != value:
        return None
  return merged


def _fits(chosen: list[Option], option: Option) -> bool:
  return (all(outcome(option.key, o.key) == 'valid' for o in chosen)
          and _merge((*chosen, option)) is not None)


def valid_cases() -> list[tuple[Option, ...]]:
  """Runs (one option per axis) that together hold every valid pair, none of them holding
  a refused or failing pair: pairwise coverage in a few runs instead of one per pair
  (AETG-style greedy: start from an uncovered pair, then per axis the option covering
  the most uncovered pairs, the default on ties). Deterministic."""
  uncovered = {_pair(a.key, b.key) for a, b in all_pairs() if outcome(a.key, b.key) == 'valid'
               and _merge((a, b)) is not None}
  cases = []
  while uncovered:
    a, b = sorted(sorted(p) for p in uncovered)[0]
    chosen = [OPTIONS[a], OPTIONS[b]]
    for axis, options in AXES.items():
      if axis in (AXIS_OF[a], AXIS_OF[b]):
        continue
      fits = [o for o in options if _fits(chosen, o)]
      gain = lambda o: sum(_pair(o.key, c.key) in uncovered for c in chosen)
      chosen.append(max(fits, key=gain))  # max keeps the first (the default) on ties
    case = tuple(sorted(chosen, key=lambda o: list(AXES).index(AXIS_OF[o.key])))
    uncovered -= {_pair(x.key, y.key) for x in case for y in case if x != y}
    cases.append(case)
  return cases


def with_defaults(*options: Option) -> tuple[Option, ...]:
  """`options` with every other axis at its default, or at the option one of them
  requires."""
  required = [OPTIONS[o.requires] for o in options if o.requires]
  given = {AXIS_OF[o.key]: o for o in (*required, *options)}
  return tuple(given.get(axis, opts[0]) for axis, opts in AXES.items())


def value_case(option: Option) -> tuple[Option, ...]:
  """A VALUES option's case: the defaults (or the option it requires), then the value."""
  return (*with_defaults(*([OPTIONS[option.requires]] if option.requires else [])), option)


def shown(option: Option) -> bool:
  """Whether the docs' matrix has a row for it (a feature's 'off' goes without saying)."""
  return bool(option.fields)


def case_id(case: tuple[Option, ...]) -> str:
  """A case by its options away from the defaults."""
  return '+'.join(o.key for o in case if o not in DEFAULTS) or 'defaults'
