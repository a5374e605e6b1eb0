"""The training loop, learning-rate rules, precision, and the run lifecycle."""
