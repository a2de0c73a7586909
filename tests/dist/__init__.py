"""Multi-process (torch.distributed) tests: a package so test modules can import helpers from `.conftest`."""
