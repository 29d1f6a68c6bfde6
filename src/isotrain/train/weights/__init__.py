"""Trained weights in and out of files: from a run, a `.safetensors` file or a Hugging Face
folder (`load`), and out again as either (`export`).

Where `sample`, `export` and `--init-from` get a model and its tokenizer. Imports `config`,
`model`, `data` and `rundir`; only `inputs`, `loop` and `cli` import it.
"""
