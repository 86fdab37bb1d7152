"""Every field of a dist_ens config: its default, and in the comment above or beside it,
its meaning and (in brackets) its check, e.g. `config.train.steps = 1000  # ... [int >= 1]`
(dist_ens.config.schema reads them; docs/config.md shows them). The default run: 8 MLP
members on MNIST-1D (generated offline), on whatever devices exist.

Every field that any model, optimizer or schedule reads is present, so any of them
can be overridden from the command line; each model reads only its own fields.

Fields marked "per member" take a number, a list of num_members numbers, or a sweep
spec such as 'loguniform(1e-4,1e-2)' or 'grid(1e-3,1e-2)' (see dist_ens/core/hparams.py):
  --config.optim.learning_rate='[0.001,0.002,0.003,0.004]'
"""

import copy
import importlib.util
import sys
from pathlib import Path

import ml_collections
from ml_collections import config_dict


def per_member(value):
  """A field that accepts a number, a list or a spec string (an untyped field)."""
  return config_dict.FieldReference(value, field_type=object)


def untyped(value):
  """A field that takes values of several types: pairs, or an import path to them."""
  return config_dict.FieldReference(value, field_type=object)


def get_config() -> ml_collections.ConfigDict:
  """The defaults: the run-wide fields here, each group's in a function of its own."""
  config = ml_collections.ConfigDict()
  # Everything random (init, data order, dropout, random sweep values) derives from the
  # seed and the member index.
  config.seed = 0  # [int >= 0]
  config.num_members = 8  # M, the ensemble size; must be divisible by mesh.member [int >= 1]
  # 'float32', or 'bfloat16': the model computes in bf16 while parameters, optimizer
  # state, BatchNorm statistics, the loss and metrics (and checkpoints) stay float32.
  config.precision = 'float32'
  # True: member i's whole trajectory is bit-identical whatever M, the mesh, the data
  # split (a divisor of train.micro_batches) and the process count, at some speed cost
  # (docs/reproducibility.md). False: fast; such changes drift by rounding.
  config.reproducible = False  # [bool]
  # What the members learn (dist_ens/tasks): 'classification' (logits over classes,
  # cross-entropy, the ensemble the mean of the members' probabilities),
  # 'regression', 'token_classification' (a class per position, targets [N, T] with -1
  # as padding: next-token prediction with the causal token_transformer and
  # model.pool='tokens'; docs/models.md), or your own task by import path,
  # 'my_pkg.tasks:my_task'.
  config.task = 'classification'
  _mesh(config)
  _model(config)
  _ensemble(config)
  _data(config)
  _optim(config)
  _train(config)
  # Where events go: 'jsonl' (metrics.jsonl), 'csv' (csv/<split>.csv), 'tensorboard',
  # 'wandb' (pip install wandb; WANDB_MODE=offline keeps it local) or your own writer
  # class by import path, 'my_pkg.sinks:MyWriter' (dist_ens/io/writers.py).
  config.writers = ('jsonl', 'tensorboard')
  _checkpoint(config)
  _select(config)
  _pbt(config)
  _eval(config)
  _distill(config)
  return config


def _mesh(config: ml_collections.ConfigDict) -> None:
  # Devices as member x data x model; -1 fills the remaining devices. hosts_along: which
  # of member and data runs across processes in a multi-host run ('model' is innermost:
  # its devices are neighbours on one host).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.member = -1  # devices along the member axis: members are split over them [int]
  config.mesh.data = 1  # devices along the data axis: each member's batch is split over them [int]
  config.mesh.hosts_along = 'member'  # the axis laid out across processes (docs/multihost.md)
  # model > 1: each member's leaves are split over a third mesh axis of this many devices
  # (members larger than one device; docs/mesh.md): by the model's own Flax partition
  # annotations where it has them, else by mesh.rules, else FSDP (each leaf of at least
  # fsdp_min_size elements split on its largest dimension that model divides).
  config.mesh.model = 1
  config.mesh.fsdp_min_size = 4096  # FSDP splits only leaves of at least this many elements
  # ZeRO-3 over both axes: the FSDP rule splits a large leaf over data x model devices
  # (a member's data-parallel devices hold a shard each, gathered per layer), not over
  # model alone; also with model = 1. Less memory per device, more collectives.
  config.mesh.fsdp_over_data = False
  # (regex over a leaf's path, spec of one member's leaf) pairs, first match wins, e.g.
  # (('attn/(q|k|v)/w$', (None, 'model')),); or an import path to such pairs,
  # 'dist_ens.models.vit:VIT_RULES'. A regex that matches no leaf is refused.
  config.mesh.rules = untyped(())
  # Flax logical axis names -> mesh axes, for with_logical_partitioning: (('embed',
  # 'model'), ('mlp', None)).
  config.mesh.logical_rules = ()


def _model(config: ml_collections.ConfigDict) -> None:
  config.model = ml_collections.ConfigDict()
  config.model.name = 'mlp'  # a built-in model (dist_ens/models), used when factory is ''
  # Your own model by import path, 'my_pkg.nets:make_net', called with model.kwargs
  # (see "Your own model, data and optimizer" in README.md); '' = model.name.
  config.model.factory = ''
  config.model.kwargs = ml_collections.ConfigDict()  # keyword arguments for model.factory
  config.model.widths = (256, 256)  # mlp hidden widths
  config.model.channels = (25, 25, 25)  # cnn conv channels,
  config.model.kernel_sizes = (5, 3, 3)  # kernel sizes
  config.model.strides = (2, 2, 2)  # and strides, per layer
  # cnn convolutions: 'xla' (lax.conv), 'patches' (slices + one matmul, which vmap
  # keeps a batched matmul instead of a grouped convolution) or 'auto' (= patches).
  config.model.conv_impl = 'auto'
  config.model.init_scale = per_member(1.0)  # multiplies the He-normal init std
  # Dropout rate (mlp: after every hidden layer; cnn: before the dense layer; resnet:
  # see docs/models.md); with eval.mc_samples > 0 it also samples at evaluation.
  config.model.dropout = 0.0
  # Start every member from pretrained weights (docs/pretrained.md): an .npz, a Flax
  # .msgpack or a .safetensors file, an orbax checkpoint directory, or a dist_ens workdir
  # (its member 0; 'PATH#i' for member i). '' = each member's own random init.
  config.model.init_from = ''
  # (regex, replacement) pairs applied in order (re.sub) to the file's leaf names to give
  # the model's ('/'-joined paths: 'head/w'); a name mapped to '' is dropped.
  config.model.init_map = ()
  # False: the head (the leaves each member owns) starts per member from (seed, member),
  # the diversity of an ensemble of fine-tuned heads; True: from the file too.
  config.model.init_owned_from_file = False


def _ensemble(config: ml_collections.ConfigDict) -> None:
  # How each device runs its block of members: 'vmap' (batched into wide ops), 'map'
  # (one member after another in a loop inside the compiled step, each member's new state
  # written back into the donated state's buffers; map_batch_size > 1 vmaps chunks of
  # members), or 'auto' (picked per model, see dist_ens/parallel/strategy.py).
  config.ensemble = ml_collections.ConfigDict()
  config.ensemble.member_parallelism = 'auto'  # 'auto', 'vmap' or 'map'
  config.ensemble.map_batch_size = 0  # members vmapped per iteration of 'map' (0: one)
  # What the members are (docs/ensemble_methods.md): 'deep' (independent members),
  # 'batchensemble' (one shared weight per layer, rank-1 factors per member),
  # 'mimo' (each member one network of mimo.heads input slots and output heads),
  # 'snapshot' (each member's schedule restarts snapshot.cycles times; every cycle's end
  # predicts), 'multiswag' (SWAG per member: swag.samples weight samples predict),
  # 'prior' (randomized priors: each member adds prior.scale times a frozen random network)
  # 'epinet' (each member's network gets an epinet: a small network of its features and
  # a random index, sampled epinet.samples times per example; ensemble.epinet),
  # 'masksembles' (one shared network, each member's fixed masks on its hidden layers),
  # 'packed' (Packed-Ensembles: each member the model at width packed.alpha * C /
  # num_members, its hidden layers in packed.gamma groups) or 'sgmcmc' (each member a
  # cyclical SGLD/SGHMC chain; its samples at each cycle's end predict).
  # Or your own method by import path, 'my_pkg.methods:make' (docs/how-it-works.md), with
  # its fields in ensemble.options (anything; the method checks them).
  config.ensemble.method = 'deep'
  config.ensemble.options = ml_collections.ConfigDict()  # your method's own fields
  _declared_in(config.ensemble, 'groups')  # member groups' field, with their code
  # Which params leaves each member owns (stacked, trained; docs/pretrained.md): 'all',
  # 'head' (the output layer), 'lora' (the head and LoRA factors of the kernels),
  # 'batchensemble' (= method='batchensemble') or a regex of leaf names ('^head/'). Every
  # other leaf is shared: stored once, frozen (no gradient, no optimizer state) unless
  # train_shared; with method='deep', or 'epinet' (own names the base network's leaves;
  # 'epinet': each member owns its epinet only, on one shared base network).
  config.ensemble.own = 'all'
  # True: the shared leaves train as one leaf each (LoRA's W too), by the sum of the
  # members' gradients, with one optimizer state and member 0's hyperparameters.
  config.ensemble.train_shared = False
  # own='lora': each member's kernel is W + (alpha / rank) * A @ B, W shared (frozen
  # unless train_shared).
  config.ensemble.lora_rank = 8
  config.ensemble.lora_alpha = 0.0  # the factors' scale is alpha / rank; 0 = rank (scale 1)
  # A regex of the kernels to adapt ('attn/|mlp/'); '' = every 2-D kernel but the head.
  config.ensemble.lora_targets = ''
  _method_fields(config)


def _method_fields(config: ml_collections.ConfigDict) -> None:
  """Each built-in method's own fields, config.ensemble.<its file's name>: declared in its
  file (dist_ens/ensembles/<name>.py) as FIELDS, so a new method is one file and one
  registry line."""
  for group, values in _schema().method_defaults().items():  # (cached: each config its copy)
    config.ensemble[group] = ml_collections.ConfigDict(copy.deepcopy(values))


def _declared_in(section: ml_collections.ConfigDict, module: str) -> None:
  """The fields a feature declares beside its code, dist_ens/config/<module>.py's FIELDS,
  placed in `section`; each takes any type (a structure, a list of dicts: the module's
  check(config) checks it)."""
  for name, value in _schema().module_defaults(module).items():
    section[name] = untyped(copy.deepcopy(value))


def _schema():
  """dist_ens/config/schema.py, loaded by its path: tools read this file without importing
  the dist_ens package (which imports jax)."""
  name = '_dist_ens_config_schema'
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name('schema.py'))
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
  return sys.modules[name]


def _data(config: ml_collections.ConfigDict) -> None:
  config.data = ml_collections.ConfigDict()
  config.data.name = 'mnist1d'  # embedded ('mnist1d', 'digits') or any prepared TFDS name
  config.data.data_dir = ''  # TFDS data_dir; '' = TFDS's default (~/tensorflow_datasets)
  # Inputs are float32 (uint8 images / 255), then standardised per channel if given.
  config.data.mean = ()
  config.data.std = ()  # per-channel standard deviations (with data.mean)
  # 'shared' (every member the same batch), 'shuffled' (own order per member) or
  # 'bootstrap' (own resample per member: bagging).
  config.data.member_order = 'shared'
  # K-fold or repeated hold-out as one run: 'kfold:K' or 'holdout:S[:F]' gives member
  # block s of M / S its own training part and held-out part of train (docs/data.md);
  # 'blocks:S': block s of train, nothing held out (S data sets of one shape as one run);
  # '' = every member trains on all of train.
  config.data.member_split = ''
  # On-device augmentation, drawn per member and per example from (seed, member, step,
  # example index): 'none', 'crop_flip' (pad 4, random crop; mirror for images) or
  # your own fn(key, x_example) -> x_example by import path, 'my_pkg.aug:fn'.
  config.data.augment = 'none'
  config.data.prefetch = 2  # batches prepared ahead on a background thread [int >= 0]
  # Who reads and decodes the host pipeline's batches (docs/data.md, "Decoding in worker
  # processes"): 'threads' (the background thread) or 'grain' (grain's worker processes,
  # for TFDS datasets: pip install 'dist_ens[grain]'). The batches and the saved data
  # position are the same either way.
  config.data.loader = 'threads'  # [one of 'threads', 'grain']
  # grain's worker processes per host (data.loader='grain'); 0 = one per CPU core.
  config.data.grain_workers = 0  # [int >= 0]
  # The training split on the devices (docs/data.md, "Resident data"): put there once,
  # each step's batches gathered on the devices from the host's indices, the same bits as
  # the host pipeline's. 'auto': when it fits data.resident_budget_mb; True: always
  # (refused if it does not fit); False: the host pipeline reads every batch.
  config.data.resident = untyped('auto')
  # The most memory a resident training split may take on each device, in MB (2^20
  # bytes). It is replicated (every device holds all of it, x and y as read; with a
  # data.member_split of a standardising task one copy per split), so it is per device,
  # not divided by the mesh. A fixed figure, not a fraction of the device's memory, so
  # that every process decides alike and a CPU (which reports none) too: 1024 MB is
  # about 1% of an H100's 80 GB and 1/16 of a 16 GB TPU chip, the rest left to the
  # members' state and activations (MNIST-1D takes 0.6 MB, CIFAR-10 as float32 600 MB).
  # Fake CPU devices each hold their own copy in host memory.
  config.data.resident_budget_mb = 1024.0  # [number >= 0]
  config.data.batch_size = 128  # each member's global batch, whatever the mesh [int >= 1]
  # Examples carved from the end of a fixed shuffle of train for validation (used by
  # select.top_k); 0 = no validation split, train on all of it.
  config.data.validation_size = 0  # [int >= 0]
  # Tokenised text, data.name='text:PATH' (docs/data.md): a folder with train and test
  # .jsonl ('input_ids' or 'text' per line, 'label') or .npz files. Each sequence is
  # cut or padded to text_length ids (0: the longest training sequence) with pad_id
  # (-1: the checkpoint's pad_token_id, model.init_from='hf:PATH', else the tokenizer's,
  # else 0). text_targets: 'label' (a class per sequence) or 'next_token' (targets [N, L]
  # for task='token_classification', -1 past each sequence's end).
  config.data.text_length = 0
  config.data.text_targets = 'label'  # 'label' or 'next_token' (above)
  config.data.pad_id = -1  # the padding id (above)
  # A tokenizer.json (or its folder) for 'text' lines; '' = the one beside the checkpoint
  # of model.init_from='hf:PATH', else PATH/tokenizer.json.
  config.data.tokenizer = ''


def _optim(config: ml_collections.ConfigDict) -> None:
  config.optim = ml_collections.ConfigDict()
  config.optim.name = 'adam'  # 'adam' (AdamW when weight_decay > 0) or 'sgd'
  config.optim.learning_rate = per_member(1e-3)  # peak learning rate
  # Decoupled weight decay for every optimizer: each step subtracts lr * weight_decay * w
  # (AdamW; SGDW for sgd) from the leaves decay_mask names: 'kernels' (weight matrices
  # and conv kernels; no biases or normalisation scales) or 'all'.
  config.optim.weight_decay = per_member(0.1)
  config.optim.decay_mask = 'kernels'  # the leaves weight_decay applies to (above)
  config.optim.b1 = per_member(0.9)  # adam
  config.optim.b2 = 0.999  # adam's second-moment decay [number in [0, 1)]
  config.optim.eps = 1e-8  # adam's epsilon [number > 0]
  config.optim.momentum = per_member(0.9)  # sgd only; 0 for plain SGD
  config.optim.nesterov = False  # Nesterov momentum for sgd
  config.optim.grad_clip_norm = 0.0  # 0 = no clipping [number >= 0]
  # Learning-rate multiplier after warmup_steps of linear warm-up: 'constant', 'cosine'
  # or 'linear' decay to 0, or 'step': x decay_factor at each of decay_boundaries,
  # fractions of train.steps (0.3, 0.6, 0.8 = epochs 60/120/160 of 200).
  config.optim.schedule = 'constant'
  config.optim.warmup_steps = 0  # linear warm-up from 0 to the peak rate first [int >= 0]
  # The warm-up in epochs instead (sets warmup_steps).
  config.optim.warmup_epochs = 0.0  # [number >= 0]
  config.optim.decay_boundaries = (0.3, 0.6, 0.8)  # schedule='step' only
  config.optim.decay_factor = 0.2  # schedule='step' only


def _train(config: ml_collections.ConfigDict) -> None:
  config.train = ml_collections.ConfigDict()
  config.train.steps = 2000  # each member sees data.batch_size examples a step [int >= 1]
  # > 0: train this many epochs instead, steps = epochs * (train examples // batch_size)
  # (the last partial batch of an epoch is dropped), set once the data set's size is
  # known; train.steps is then ignored. 0: train.steps counts.
  config.train.epochs = 0  # [int >= 0]
  # '' = config.task's own loss (classification: softmax cross-entropy with
  # label_smoothing; regression: the Gaussian NLL), a name in dist_ens.tasks.LOSSES
  # ('cross_entropy', 'gaussian_nll', 'mse'), or your own by import path,
  # 'my_pkg.losses:fn' with fn(outputs, targets, hparams) -> mean loss.
  config.train.loss = ''
  config.train.label_smoothing = per_member(0.0)  # of the cross-entropy
  # Each member's batch is cut into this many micro-batches whose gradients are summed
  # (in a fixed order when config.reproducible): activations take 1/micro_batches of
  # the memory. BatchNorm normalises each micro-batch by its own statistics.
  config.train.micro_batches = 1  # [int >= 1]
  config.train.log_every = 250  # steps between train log lines and metrics events [int >= 1]
  config.train.eval_every = 500  # 0: evaluate only at the end [int >= 0]
  # Wait for the step every this many steps; 0 = automatic (8 on multi-device CPU,
  # whose collectives deadlock when ~30 steps are queued; else at log steps only).
  config.train.sync_every = 0  # [int >= 0]
  # Steps run per call of the compiled step (a lax.scan on the device): small steps are
  # limited by the host's per-call work (a batch transfer, a dispatch). 0 = auto: the
  # largest divisor of steps, log_every, eval_every and checkpoint.every up to 100, on a
  # CPU also holding at most 1e10 training FLOPs per device a call
  # (dist_ens/parallel/strategy.py). A value K > 0 needs those to be multiples of K.
  config.train.steps_per_call = 0  # [int >= 0]
  # A member whose loss or gradient goes non-finite: 'freeze' it and train the
  # others on, or 'stop' (save, then exit with an error).
  config.train.on_nonfinite = 'freeze'  # [one of 'freeze', 'stop']
  # Trace this many steps with jax.profiler after the first log_every steps, to
  # workdir/profile (open with TensorBoard's profile plugin); 0 = off.
  config.train.profile_steps = 0


def _checkpoint(config: ml_collections.ConfigDict) -> None:
  config.checkpoint = ml_collections.ConfigDict()
  # Steps between (asynchronous) checkpoints; also at the end.
  config.checkpoint.every = 500  # [int >= 1]
  config.checkpoint.keep = 2  # newest checkpoints kept [int >= 1]
  # Comma-separated fields (or prefixes, e.g. 'optim') allowed to differ from the
  # workdir's saved config on resume. Steps, logging, eval and mesh always may.
  config.checkpoint.restore_incompatible = ''


def _select(config: ml_collections.ConfigDict) -> None:
  # Members ranked by a validation metric ('nll', 'accuracy', 'brier' or 'ece'); top_k > 0
  # also reports the ensemble of the k best (needs data.validation_size > 0).
  config.select = ml_collections.ConfigDict()
  config.select.metric = 'nll'  # the validation metric members are ranked by
  config.select.top_k = 0  # the selected ensemble's size; 0 = no selection [int >= 0]
  # 'top_k' (the top_k best by select.metric, each once; results 'selected') or 'greedy'
  # (Caruana: add, with replacement unless greedy_replacement=False, the member that most
  # lowers the validation NLL of the averaged probabilities, greedy_size picks, best prefix
  # kept; results 'greedy').
  # Both need data.validation_size > 0 (docs/ensemble_methods.md).
  config.select.method = 'top_k'
  config.select.greedy_size = 0  # picks for 'greedy'; 0 = num_members
  # False: 'greedy' picks each member at most once (distinct members, for a budget of K at
  # prediction time); True: Caruana's, with replacement (a member picked twice counts twice).
  config.select.greedy_replacement = True  # [bool]


def _pbt(config: ml_collections.ConfigDict) -> None:
  # Population-based training over the members (docs/sweeps.md): every pbt.interval steps
  # the members are ranked on the validation split (needs data.validation_size > 0); the
  # worst pbt.quantile copy the whole train state of one of the best (exploit) and take its
  # hyperparameters perturbed (explore). Needs per-member hyperparameters to explore.
  config.pbt = ml_collections.ConfigDict()
  config.pbt.enabled = False  # True: the rounds above run [bool]
  config.pbt.interval = 500  # steps between exploit/explore rounds (never at the last step)
  config.pbt.metric = 'nll'  # validation metric ranked by ('nll', 'accuracy', 'brier', 'ece')
  config.pbt.quantile = 0.25  # fraction of members replaced each round, in (0, 0.5]
  # Fields explored (e.g. ('optim.learning_rate',)); () = every per-member field that varies.
  config.pbt.fields = ()
  # A replaced member's value is its source's times one of these, picked at random,
  config.pbt.perturb_factors = (0.8, 1.2)
  # or, with this probability, a fresh draw from the field's sweep spec (a list or grid:
  # one of its values); either is reflected into the spec's range at a bound it crosses.
  config.pbt.resample_probability = 0.25
  config.pbt.seed = 0  # the decisions depend only on (pbt.seed, round, the metric values)


def _eval(config: ml_collections.ConfigDict) -> None:
  config.eval = ml_collections.ConfigDict()
  # Rounded up to a multiple of mesh.data; the last batch is masked.
  config.eval.batch_size = 1000  # [int >= 1]
  # Your own metrics by import path, fn(outputs [B, ...], targets [B]) -> [B] per example:
  # averaged per member and for the ensemble like the built-in ones (docs/evaluation.md).
  config.eval.metrics = ()
  # Your own evaluators by import path, fn(run: dist_ens.evaluators.evaluator.EvalRun) ->
  # list of loop actions (none where the run does not ask for it): they run after the
  # built-in ones at every step (docs/how-it-works.md, "An evaluator of your own").
  config.eval.evaluators = ()
  # Out-of-distribution inputs scored at the end by the ensemble's uncertainty (AUROC/AUPR
  # by predictive entropy and by mutual information, under 'ood' in final_metrics.json):
  # '' = none; 'mnist1d_noise' or 'mnist1d_shuffled' (dist_ens/ood.py), or any dataset
  # name with the model's input shape (its test split, e.g. 'mnist' for fashion_mnist).
  config.eval.ood_dataset = ''
  # MC dropout: K > 0 also reports test (and OOD) metrics with K dropout samples per member
  # (models whose apply samples dropout when given an rng with train=False), under
  # 'mc_dropout'; 0 = off.
  config.eval.mc_samples = 0
  # Fit a temperature per member and one for the ensemble on the validation split (needs
  # data.validation_size > 0); test metrics before and after under 'temperature_scaling'.
  config.eval.temperature_scaling = False
  # Last-layer Laplace per member (docs/ensemble_methods.md; classification, method
  # 'deep'): '' = off, 'last_layer_diag', 'last_layer_kron' or 'last_layer_full' (the
  # Gauss-Newton matrix's form); test metrics of the members' Laplace predictives and
  # their mixture under 'laplace', the prior precision chosen on the validation split
  # (else by marginal likelihood). Saved to workdir/laplace.npz, which
  # Ensemble.predict(x, laplace=True) predicts with.
  config.eval.laplace = ''
  # 0: the probit approximation of the predictive; k > 0: the mean over k draws of the
  # last layer's weights (with eval.joint_tau, their joint log-loss under 'laplace').
  config.eval.laplace_samples = 0
  # Distribution shift: the test split corrupted on device (docs/evaluation.md), per
  # corruption and severity the members' and the ensemble's metrics and their means
  # (cA, cNLL, cCE), under 'shift' in final_metrics.json. '' = off; 'all' (every family
  # that applies to the inputs, severities 1-5); or a comma list of 'name' (severities
  # 1-5), 'name:k' or 'name:j-k', e.g. 'gaussian_noise:1-5,contrast:3'; or
  # 'tfds:NAME' (e.g. 'tfds:cifar10_corrupted'): instead, the test split of every locally
  # prepared TFDS config NAME/CORRUPTION_SEVERITY.
  config.eval.shift = ''
  # mCE: a finished run's workdir evaluated on the same eval.shift pairs, whose ensemble
  # errors normalise this run's per corruption (ImageNet-C's mCE and relative mCE, for the
  # ensemble and the mean member, under 'shift'). '' = none.
  config.eval.shift_baseline = ''
  # Conformal prediction: with data.validation_size > 0, sets (classification, APS) or
  # intervals (regression) calibrated on the validation split to hold the label with
  # probability 1 - alpha; test (and shifted) coverage and size under 'conformal'.
  config.eval.conformal_alpha = 0.1  # [number in (0, 1)]
  # Joint predictions (the Neural Testbed's dyadic sampling, docs/evaluation.md): the
  # members' and the ensemble's mean negative log-likelihood of tau test labels at once,
  # each batch of tau drawn from 2 anchor examples, under 'joint' in final_metrics.json
  # (nats per batch, not divided by tau). Any task with Task.log_likelihood; 0 = off.
  config.eval.joint_tau = 10  # [int >= 0]
  # How many dyadic batches are averaged (drawn from (seed, the test split) only).
  config.eval.joint_batches = 1000  # [int >= 1]


def _distill(config: ml_collections.ConfigDict) -> None:
  # Distillation after the last step (docs/ensemble_methods.md; classification, method
  # 'deep'): the members' mean probabilities at distill.temperature on the training
  # inputs taught to a student, whose test metrics and inference cost go under 'distill'
  # in final_metrics.json; saved to workdir/student.npz (Ensemble.load(workdir).student()).
  config.distill = ml_collections.ConfigDict()
  # '' = off; 'same' (one network of the members' model, fresh init); 'hydra' (the
  # built-in MLP's hidden layers shared, one output layer per member, each matched to its
  # member); or 'my_pkg.nets:make', make(num_outputs) -> a dist_ens.Model.
  config.distill.student = ''
  config.distill.steps = 1000  # the student's Adam steps (> 0 with a student)
  config.distill.temperature = 2.0  # T of the soft targets; the loss is scaled by T^2
  config.distill.learning_rate = 1e-3  # the student's Adam learning rate
  config.distill.batch_size = 0  # training examples per student step; 0 = data.batch_size
