"""How a corpus becomes batches: sources on disk, tokenizers, prepared folders, the sampler.

`sources` finds text or token ids and splits them train/val, `tokenizer` turns text into ids
(bytes, BPE, `tokenizer.json`, raw ids), `batches` holds the corpus as token arrays and draws
batch k as a pure function of (seed, step, micro-step, rank), `prepare` writes the
`train.bin` / `val.bin` folders `isotrain prepare` makes. This room imports nothing else of
the trainer: every other room may import it.
"""
