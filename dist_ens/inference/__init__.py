"""A trained run used: Ensemble.load (ensemble.py) and what it reads beside the state
(saved_run.py), its members one by one, exported and as PEFT adapters (members.py),
predictions and their types (prediction.py), and the distilled student (student.py).
"""
