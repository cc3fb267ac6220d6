"""A killed run's leftovers are closed by the next run in the same work folder.

The work-folder lock (flows.locks) records the Prefect flow run that holds the folder and is
cleared when a run ends, however it ends, short of being killed. So a run that takes the lock
over and finds a record left behind knows that flow run died: it marks the flow run Crashed in
Prefect (it would show Running forever) and the MLflow stage runs it left RUNNING as FAILED.
"""

from __future__ import annotations

from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.states import Crashed

from flows.tracking import TrackingContext


def close_orphans(ctx: TrackingContext, killed: dict) -> list[str]:
    """Close what the killed holder `killed` (its lock record) left open; say what was done."""
    flow_run_id = killed.get("flow_run_id")
    if not flow_run_id or flow_run_id == ctx.flow_run_id:
        return []
    done = []
    client = MlflowClient(ctx.uri)
    running = client.search_runs(
        [ctx.experiment_id],
        filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and attributes.status = 'RUNNING'",
    )
    for run in running:
        client.set_terminated(run.info.run_id, status="FAILED")
    if running:
        done.append(f"{len(running)} MLflow run(s) marked FAILED ({', '.join(r.info.run_name for r in running)})")
    message = f"killed (pid {killed.get('pid')} on {killed.get('host')}); closed by flow run {ctx.flow_run_id}"
    with get_client(sync_client=True) as prefect:
        state = prefect.read_flow_run(flow_run_id).state
        if state is not None and not state.is_final():
            prefect.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
            done.append(f"Prefect flow run {flow_run_id} marked Crashed")
    return done
