from scaletrain.cli import run_as_module

run_as_module()
