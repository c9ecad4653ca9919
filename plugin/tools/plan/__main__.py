"""``python -m vllm_kvguard.tools.plan``: the ``kvguard plan`` command line."""
import sys

from vllm_kvguard.tools.plan.preflight import main

sys.exit(main())
