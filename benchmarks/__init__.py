"""The benchmark scripts, run from the repository root as `python -m benchmarks.NAME`.

A regular package (not a namespace one), so `from benchmarks import harness` finds this
folder and no other `benchmarks` directory that happens to be on sys.path.
"""
