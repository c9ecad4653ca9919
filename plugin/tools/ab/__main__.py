"""``python -m vllm_kvguard.tools.ab``: the ``kvguard ab`` command line."""
import sys

from vllm_kvguard.tools.ab.cli import main

sys.exit(main())
