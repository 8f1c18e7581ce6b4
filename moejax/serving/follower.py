"""A follower process of a server spanning several processes: no HTTP server, no scheduler
policy; it runs the calls of process 0's step plan, in order, on its own shards of the same
compiled programs (both warmed up alike), acknowledging each."""

from __future__ import annotations

import os
import sys

from moejax.serving.plan_link import FollowerLink, Lost


def follow(scheduler, process_id: int) -> int:
    """Runs process 0's calls until it says stop (-> 0). Losing process 0, or a call failing
    (a collective whose other end is gone), exits non-zero at once: jax.distributed's shutdown
    would wait for the lost process."""
    print(
        f"moejax serve: process {process_id} follows process 0's step plans; no HTTP server here "
        "(--host and --port are ignored)",
        file=sys.stderr,
        flush=True,
    )
    try:
        link = FollowerLink(process_id)
        for call in link.calls():
            scheduler.execute(call)
            link.ack()
    except Exception as e:  # noqa: BLE001 - any end of the plan but STOP is this process's failure
        why = str(e) if isinstance(e, Lost) else f"a step failed: {type(e).__name__}: {e}"
        print(f"moejax serve: process {process_id}: {why}; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    print(f"moejax serve: process {process_id}: process 0 stopped the plan; exiting", file=sys.stderr, flush=True)
    return 0
