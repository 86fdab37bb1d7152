"""Runnable examples: one model per framework, trained with dist_ens through config.model.factory.

Run one from the repository root, e.g.
  python -m examples.flax_linen_resnet /tmp/linen_run
"""
