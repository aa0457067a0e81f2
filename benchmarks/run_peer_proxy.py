"""Run the peer harness ``shared/bench/peer/proxy_overhead.py`` against our gateway.

The harness is imported from ``../shared/bench/peer`` (read-only, not copied); our adapter
(``benchmarks/peer_ours.py``) is registered in its ``ADAPTERS`` table, then the harness's own
``main()`` runs, so all its flags work:

    .venv/bin/python benchmarks/run_peer_proxy.py --impl ours [--duration 4] [--json-out F]

Set ``VOLTRL_PEER_BENCH`` to use another harness directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = Path(os.environ.get("VOLTRL_PEER_BENCH", HERE.parent.parent / "shared" / "bench" / "peer"))


def main() -> None:
    """Plug our adapter into the harness and hand over to its command line."""
    if not (PEER / "proxy_overhead.py").exists():
        sys.exit(f"peer harness not found at {PEER} (set VOLTRL_PEER_BENCH)")
    sys.path[:0] = [str(PEER), str(HERE)]
    import proxy_overhead
    from peer_ours import OursProxyAdapter

    proxy_overhead.OursProxyAdapter = OursProxyAdapter
    proxy_overhead.ADAPTERS["ours"] = OursProxyAdapter
    proxy_overhead.main()


if __name__ == "__main__":
    main()
