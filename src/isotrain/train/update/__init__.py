"""How gradients become a weight update: AdamW's parameter groups and the LR schedule as a
pure function of step (`optim`), and the update rules behind `Updater` (`updater`: the
guarded one and a plain clip-and-step).

Imports `config`, `parallel` and `state`; `step` and `loop` import it.
"""
