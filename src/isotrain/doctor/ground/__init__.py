"""The ground every check stands on: running the user's step on their own objects and
putting everything back (context, snapshot, globals), how the user's code is driven and
called (steps: their step, loss_fn or epoch; inputs: the model's call as their step makes it),
watching what the step calls (watch: ops, calls: Python calls, trace: the step called several
times, probe: one step measured), a DataLoader's sampler drawn without moving it (sampling),
and what a check is and reports (kinds, finding).

Kinds: `doctor_error`.
"""
