"""The GPT and what is done with it in memory: the module, GPT-2's layout, sampling.

`gpt` is the pure `nn.Module`, `shape` its `GPTConfig` (no torch: the CLI parses it before
torch is imported), `hf` maps its weights to and from Hugging Face GPT-2 names, `sampling`
draws text through a tokenizer with every mode and RNG put back. Imports `data` (tokenizers)
and `fields` only; reading weights from files is `weights`' job.
"""
