"""The token tables in training: row-sparse table optimizers (`optim`), tables kept in host memory (`host`),
and the one look-ahead worker both use to fetch the next step's rows while this one computes (`lookahead`)."""
