"""Trained weights in and out of files: from a run, a `.safetensors` file or a Hugging Face
folder (`load`), and out again as either (`export`).

Where `sample`, `export` and `--init-from` get a model and its tokenizer. A file from outside
is untrusted: `header` reads a `.safetensors` header itself and `checks` holds its model config
to the CLI's rules and its tensors to that config, all before a model is built. Imports `config`,
`model`, `data` and `rundir`; only `inputs`, `loop` and `cli` import it.
"""
