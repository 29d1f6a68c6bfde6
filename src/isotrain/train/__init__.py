"""The reference trainer: a GPT trained with all five isotrain patterns at once.

An application of the library, not part of it: `isotrain.train` imports the public pattern
packages, never the reverse. Start reading at `loop.train`; `step.train_step` is one step and
`state` what a run is made of. The rooms (`data`, `model`, `update`, `rundir`, `weights`,
`report`, `cli`) each own one concept, and imports between them point one way
(`tests/test_layout.py` holds the order).
"""
