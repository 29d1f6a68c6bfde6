"""The reference trainer: a GPT trained with all five isotrain patterns at once.

An application of the library, not part of it: `isotrain.train` imports the pattern modules,
never the reverse.
"""
