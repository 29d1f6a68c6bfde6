"""The `isotrain` command: argument parsing (`args`), the commands other than `train`
(`commands`), `train --help` (`helptext`), `train --nproc-per-node` (`launch`: torchrun's
launcher in this process) and the entry point (`main`).

Parsing and wiring only: the top of the import graph, which nothing else imports.
"""
