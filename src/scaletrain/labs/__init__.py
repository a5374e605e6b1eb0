"""The labs of `scaletrain lab` (cli/lab.py): one module per lab, each with add_parser() and run()."""
