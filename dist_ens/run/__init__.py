"""The one place that wires a run: build_run turns a config into a Run (assemble.py):
the mesh and the layout (mesh_layout.py), the data, its orders and member splits
(run_data.py), how each device runs its members (member_forms.py), the parts
(model, task, method, optimizer, hyperparameters, abstract state) that training,
`dist-ens plan` and Ensemble.load all build alike, and the initial state born sharded
from them (initial_state.py).
"""
