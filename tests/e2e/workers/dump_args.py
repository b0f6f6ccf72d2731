"""A tiny worker for launcher tests: rebuild NeoXArgs like a real worker and dump them to JSON."""

import json
import os

from megatron.neox_arguments import NeoXArgs

args = NeoXArgs.consume_neox_args()
out_dir = os.environ["NEOX_TEST_OUT"]
with open(os.path.join(out_dir, f"rank{args.rank}.json"), "w", encoding="utf-8") as handle:
    json.dump(args.to_dict(), handle, sort_keys=True)
