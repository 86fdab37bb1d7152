"""Deep ensembles (Lakshminarayanan et al. 2017; config.ensemble.method='deep', the
default): independent members, each trained member predicts. The only method whose
members may share leaves by config.ensemble.own (a frozen or jointly trained backbone,
LoRA; ensembles/own.py) and that PBT may copy whole."""

from dist_ens.ensembles.method import Method, MethodSpec


def make(spec: MethodSpec) -> Method:
  lora = (spec.lora_rank, spec.lora_alpha, spec.lora_targets) if spec.own == 'lora' else None
  return Method('deep', allows_own=True, copyable=True, own=spec.own, lora=lora,
                train_shared=spec.train_shared)
