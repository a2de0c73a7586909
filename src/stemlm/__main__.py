"""`python -m stemlm [--debug] COMMAND [flags]`: the `stemlm` console script (stemlm.cli.main), for an environment
where the script is not on PATH, e.g. `python -m stemlm train --out runs/tiny`. The library never imports it."""

import sys

from stemlm.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
