"""Generators for the hardening suites: hostile pickles and broken checkpoints, built at test time into a
temporary folder from the committed samples (no binary pickles are committed)."""
