"""`torchrun ... titan_launch.py --module M --config F`: the package's torchtitan launcher
(`lowprec.integrations.torchtitan_launch`: torchtitan's own `main()` after the pipeline-schedule
adapter, the timeout change and, without an accelerator, the CPU device), started as a script
from this folder so that the job modules the tests write beside it are importable."""

import sys

from lowprec.integrations.torchtitan_launch import main

if __name__ == "__main__":
    sys.exit(main())
