"""The config: every field's default, meaning and check, declared once (defaults.py), and
read from it (dist_ens.config_schema). It ships inside the package, so a wheel install
checks a config as a checkout does; configs/ holds presets that start from it.
"""
