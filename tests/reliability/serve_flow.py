"""``python -m tests.reliability.serve_flow NAME``: serve the train-and-export flow as deployment NAME
on the server in PREFECT_API_URL (flow runs execute in child processes, as with a worker), so a test
can cancel a flow run the way the UI does. ``prefect.serve(flow.to_deployment(...))`` as infra.serve
does: the child process imports the flow from its entrypoint."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from prefect import serve

    from flows.train_and_export import train_and_export

    serve(train_and_export.to_deployment(name=sys.argv[1]), limit=1, print_starting_message=False)
