import os
import sys

from trainer.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Under torchrun the work is done and written (atomically) by now. Leave without the interpreter's teardown:
    # C++ threads of the distributed backends (DeepSpeed ZeRO-3 over gloo, seen in CI) can abort the process
    # with "terminate called without an active exception" while being torn down, turning a finished run into a
    # SIGABRT that torchrun reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
