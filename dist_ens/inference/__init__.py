"""A trained run used: Ensemble.load, prediction and its members one by one, exported and
as PEFT adapters (ensemble.py), what a load reads beside the state (saved_run.py),
predictions and their types (prediction.py), and the distilled student (student.py).
"""
