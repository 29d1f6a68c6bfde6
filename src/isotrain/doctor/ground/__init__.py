"""The ground every check stands on: running the user's step on their own objects and
putting everything back (context, snapshot, globals), watching what the step calls (watch:
ops, calls: Python calls, trace: the step called several times, probe: one step measured),
and what a check is and reports (kinds, finding).

Kinds: `doctor_error`.
"""
