"""Stand-in of nanoGPT's configurator.py: exec a config file, then apply --key=value overrides."""

import sys
from ast import literal_eval
from pathlib import Path

for arg in sys.argv[1:]:
    if "=" not in arg:
        exec(Path(arg).read_text())
    else:
        key, val = arg[2:].split("=", 1)
        if key not in globals():
            raise ValueError(f"Unknown config key: {key}")
        globals()[key] = literal_eval(val)
