"""The config, read once at the edge: every field's default, meaning and check declared
once (defaults.py, a method's in its file, member groups' with their code in groups.py;
schema.py reads the declarations), config files loaded and their fields checked against
the defaults (loading.py), the checks that span fields (checks.py), the --config flag and
its overrides (command_line.py), and the typed specs the rest of the package takes
instead of a ConfigDict (specs.py). It ships inside the
package, so a wheel install checks a config as a checkout does; configs/ holds presets
that start from the defaults.
"""
