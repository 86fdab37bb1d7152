"""python -m dist_ens.plan --config=...: the same as dist-ens plan."""

import sys

from dist_ens.plan.planner import main

sys.exit(main())
