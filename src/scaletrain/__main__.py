import logging
import os
import sys

from scaletrain.cli import main
from scaletrain.env import die_with_launcher, under_launcher

die_with_launcher()  # a torchrun worker: killed with its agent, not left training on as an orphan
code = main()
if under_launcher():
    # A worker of a torchrun job, done: leave without the interpreter's teardown. Gloo's threads can outlive
    # it (FSDP's mesh and DCP hold their groups past destroy_process_group), and one of them taking the GIL
    # then aborts the process after its work is saved ("terminate called without an active exception",
    # SIGABRT; CI, about 1 run in 10 of a 2-rank job). Everything it wrote is closed; flush what is buffered.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
