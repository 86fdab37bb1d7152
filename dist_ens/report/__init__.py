"""`dist-ens report`: a finished run's plots, report.md and report.html (build.py), from
what the workdir holds (data.py) and the run's predictions (stats.py), drawn (plots.py,
scatter.py; regression.py and pbt.py for those runs) and laid out (pages.py).
"""
