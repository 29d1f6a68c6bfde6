"""What a run shows and records: the header and its lines (`header`), the console
(`progress`), the loggers behind `--report.loggers` (`loggers`), and the plots and table of
a run (`plots`).

Reads a run only through `rundir` (the metrics file, the snapshot pointers) and writes
only through `rundir.writes`; only `loop` and `cli` import it.
"""
