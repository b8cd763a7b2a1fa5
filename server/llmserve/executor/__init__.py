"""Tensor parallelism across processes and nodes: group.py (where ranks run, how they meet),
step_message.py (what rank 0 sends each step), executor.py (rank 0), worker.py (the others),
node.py (a node other than 0: its workers, restarted with the group). The sharded model itself is
layers/parallel.py."""
