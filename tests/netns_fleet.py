"""Run vLLM instances (``tests/vllm_app.py`` specs) at the same time on one
Mooncake Store started here. Mooncake's transfer engine binds every
interface, so the caller runs this under ``unshare -n`` (a private network
namespace, loopback only):

    unshare -n sh -c 'ip link set lo up && exec python tests/netns_fleet.py SPECS OUT'

``SPECS`` is a JSON list of app specs whose ``extra.storage_url`` is
``"{url}"`` (the master's address, known once it runs); ``OUT`` gets the
JSON list of their results, in order.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest_storage import MooncakeServers, wait_until  # noqa: E402
from vllm_runs import run_app  # noqa: E402

from kvcached.storage import open_backend  # noqa: E402


def main(specs: list[dict], out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kvcached-netns-fleet-") as tmp:
        servers = MooncakeServers(Path(tmp))
        try:
            servers.start_master()
            servers.start_node()
            # the node's segment is mounted once a put succeeds
            probe = open_backend("mooncake", servers.url)
            wait_until(lambda: probe.put_from(["ready/probe"], [b"x"]) == [True], 30,
                       "the Mooncake storage node's segment")
            probe.close()
            for spec in specs:
                spec["extra"]["storage_url"] = servers.url
            with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
                results = list(pool.map(run_app, specs))
        finally:
            servers.stop()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
