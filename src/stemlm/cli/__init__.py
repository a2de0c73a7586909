"""Command-line interface: one console script `stemlm`, one module per subcommand (see `main.py`)."""
